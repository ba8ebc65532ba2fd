"""SmolLM2 (the recipe): does weighting the draft's loss by where decoding drafts from
(`draft.anchor_weight`) raise real tau? Fine-tunes one saved EAGLE-3 draft for the same few
steps at each weight, on the same kept answers and policy outputs (computed once), then measures
each (and the draft as it was) in real speculative sampling on the same prompt sets.
docs/results/real_model.md, "Where drafting starts".

    python docs/results/real_model/anchor_weight_finetune.py DRAFT_DIR OUT_DIR WEIGHTS SEEDS \
        [overrides ...]

WEIGHTS: comma-separated draft.anchor_weight values (0 = the control: the same fine-tune with
uniform weights). SEEDS: the prompt sets of the tau check (`draft_tau_check.py`'s). The
overrides set the fine-tune (draft.train_steps, draft.lr, draft.num_train_prompts, ...) and must
name the fields the answers in the draft's out_dir were sampled with.
Since stop 51 the policy's targets follow draft.autocast (bf16 in the recipe); this script's
logs were made with fp32 targets (add draft.autocast= to the overrides to compute them so).
"""
import sys
from pathlib import Path

import torch

from cospec.artifacts import answer_store, load_policy, pick_device, starting_policy_fields
from cospec.config import resolve
from cospec.data.prompts import TaskData
from cospec.draft.offline import fit_draft, sample_responses
from cospec.draft.policy_outputs import policy_batches
from cospec.evaluate import measure_speculation
from cospec.models.draft_checkpoint import load_draft, save_draft
from cospec.models.loading import with_checkpoint_model


def tau_line(name, cfg, policy, draft, data, seeds):
    taus = []
    for seed in seeds:
        with torch.inference_mode():
            spec, _ = measure_speculation(cfg, policy, draft, data, seed=seed)
        taus.append(spec.stats.accept_length)
        print(f"{name} (prompts of seed {seed}): tau {taus[-1]:.3f}, acceptance by position "
              f"{[round(a, 3) for a in spec.stats.acceptance_by_position]}", flush=True)
    print(f"{name}: mean tau {sum(taus) / len(taus):.3f}", flush=True)


def main(draft_dir: str, out_dir: str, weights: list[float], seeds: list[int], overrides: list[str]):
    torch.set_num_threads(2)
    cfg = with_checkpoint_model(resolve("smollm2-math", overrides=overrides))
    start = load_policy(cfg, pick_device(cfg.device))
    policy, data = start.policy.eval(), TaskData.from_config(cfg.task, start.tokenizer)
    device = next(policy.parameters()).device
    store = answer_store(cfg, starting_policy_fields(cfg))
    train = sample_responses(cfg, policy, data, store=store)
    held = sample_responses(cfg, policy, data, split="held_out", store=store)
    base = load_draft(draft_dir, device=device)
    batches = policy_batches(cfg, policy, train, vocab_ids=base.vocab_ids, progress=True)
    held_batches = policy_batches(cfg, policy, held, vocab_ids=base.vocab_ids)
    tau_line("as saved", cfg, policy, base.eval(), data, seeds)
    for w in weights:
        cfg_w = resolve("smollm2-math", overrides=overrides + [f"draft.anchor_weight={w}"])
        cfg_w = with_checkpoint_model(cfg_w)
        draft = load_draft(draft_dir, device=device)
        metrics = fit_draft(cfg_w, draft, batches, held_batches)
        for h in metrics["held_out"]:
            print(f"anchor_weight {w}: step {h['step']} held out "
                  f"{[round(a, 3) for a in h['acceptance']]}", flush=True)
        print(f"anchor_weight {w}: {metrics['train_seconds']:.0f} s of training", flush=True)
        save_draft(draft, Path(out_dir) / f"anchor_weight_{w}")
        tau_line(f"anchor_weight {w}", cfg, policy, draft.eval(), data, seeds)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], [float(x) for x in a[2].split(",")], [int(x) for x in a[3].split(",")], a[4:])
