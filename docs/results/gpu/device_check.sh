#!/usr/bin/env bash
# The GPU checks of the open issues as one prepared pass, for a session whose task is lent a device
# machine (15 minutes of device time in all, the machine's start included). Call it so:
#
#   run(command="bash docs/results/gpu/device_check.sh", carry=["runs/default"], timeout_s=540)
#
# (the limits below add up to 480 s; a lease is 15 minutes, the start included, which leaves room
# to run one check again) or name some: `bash docs/results/gpu/device_check.sh rollout demo`.
# The checks, in order:
#   env       torch, the GPU
#   engines   docs/results/gpu/cuda_checks.py: greedy plain / speculative / adaptive tokens equal on
#             the GPU, and the device syncs of a speculative step (issue 16: at most 2 a step)
#   rollout   `cospec bench rollout --no-hf` on the default workload, batch 1-64 (issue 16's
#             adaptive >= 0.97x, measured/ideal >= 0.9, batch 1 >= 2.0x)
#   block     `cospec bench rollout --drafts block` at gamma 8, batch 1 and 16, --quick, on the
#             default workload (worked solutions of ~40 tokens: the long answers of the default
#             since 2026-12-04; `--workload long` needs a policy SFT'd on copy, which the default
#             is not) (issue 17: >= 2.0x plain at batch 1, >= 1.3x at 16; EAGLE-3's best is the
#             rollout check's); trains the gamma-8 block draft first, on a copy of the SFT policy
#   demo      `cospec demo` reusing the SFT policy and draft (issue 16: co-trained end to end >= 1.3x,
#             rollouts >= 1.6x)
# runs/default must hold the embedded default's SFT policy and EAGLE-3 draft (`cospec draft-train`
# makes both here in ~8 minutes; 21 MB, well inside what a run carries). The device has torch,
# transformers, rich, matplotlib and pyyaml; nothing can be installed there, so cospec runs from the
# tree (PYTHONPATH). Each check has its own time limit and leaves its log and JSON under $OUT,
# which comes back; a check that fails or runs out of time does not stop the others. On a machine
# without a GPU the same pass runs on the CPU, slowly (LIMIT_SCALE=10): env and engines were tried
# so, and block up to its limit, before any GPU was lent.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/device_check}
SCALE=${LIMIT_SCALE:-1}   # stretch every limit (a CPU try needs ~10); at least 1
mkdir -p "$OUT"
[ "$SCALE" -ge 1 ] || { echo "LIMIT_SCALE must be >= 1 (timeout 0 would mean no limit)"; exit 2; }
CHECKS=${*:-env engines rollout block demo}

check() {  # check NAME SECONDS COMMAND...: run it under its limit, its output to OUT/NAME.log
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc after $(( SECONDS - t0 )) s"
}

for c in $CHECKS; do
  case $c in
    env) check env 30 $PY -c "import torch; c = torch.cuda.is_available(); print(torch.__version__, \
'cuda' if c else 'cpu', torch.cuda.get_device_name(0) if c else '', torch.get_num_threads(), 'threads')";;
    engines) check engines 90 $PY docs/results/gpu/cuda_checks.py "$OUT/engines.json";;
    rollout) check rollout 150 $PY -m cospec bench rollout --no-hf --reuse --json "$OUT/rollout.json" \
        out_dir=runs/default;;
    block)
      mkdir -p runs/device-block8
      cp -r runs/default/sft runs/default/sft_metrics.json runs/device-block8/
      check block 120 $PY -m cospec bench rollout --quick --no-hf --drafts block \
        --batch-sizes 1,16 --json "$OUT/rollout_block.json" \
        out_dir=runs/device-block8 rollout.gamma=8 draft.ttt_steps=8;;
    demo) check demo 90 $PY -m cospec demo --reuse out_dir=runs/default \
        && cp runs/default/summary.json "$OUT/demo_summary.json" 2>/dev/null;;
    *) echo "unknown check $c (env engines rollout block demo)";;
  esac
done
ls -la "$OUT"
