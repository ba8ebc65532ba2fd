"""Weight dtypes by name, and the mixed-precision context training forwards run in.

``grpo.autocast = "bfloat16"`` runs the policy step's forwards under `torch.autocast` (and
``draft.autocast`` the draft's training forwards): matmuls in bf16, reductions, softmaxes and the
losses (which upcast their logits explicitly) in fp32; weights, gradients and optimizer state
stay in ``model.dtype``. On CPUs with AMX this makes a SmolLM2 forward + backward 2.3-3.5x faster
(docs/results/real_model.md); on GPUs it is how RL trainers run. The backward runs outside the
context, as PyTorch recommends: it follows the dtypes the forward recorded.

Hand-written attention (the draft's trunk + branch attention, the context-parallel ring) runs
`outside_autocast`: autocast would put its score matmuls in bf16, and the softmax backward,
ds = p * (dp - delta), a difference of near-equal terms, then keeps little of the q and k
gradients (cosines 0.2-0.65 with the fp32 ones on SmolLM2's draft, docs/results/real_model.md;
docs/design.md, "Precision of the attention under mixed precision"). That is what made the
EAGLE-3 TTT loss stop learning under bf16 autocast; fused kernels (SDPA, FlashAttention)
accumulate in fp32 for the same reason.
"""

from __future__ import annotations

import contextlib
import functools
import platform

import torch

from cospec.config import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(dtype: str, device: torch.device | str):
    """torch.autocast on the device's type in ``dtype`` ("" = a no-op context)."""
    if not dtype:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])


def autocast_off(device: torch.device | str):
    """A context in which autocast is off for the device's type (a no-op where it has none)."""
    device_type = torch.device(device).type
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def outside_autocast(fn):
    """`fn(tensor, ...)` run with autocast off on its first argument's device: its matmuls run in
    the dtype it casts its inputs to (fp32 accumulation), not in autocast's."""
    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        with autocast_off(first.device):
            return fn(first, *args, **kwargs)
    return run


def cpu_lacks_bf16_matmul() -> bool:
    """True on an x86 CPU that has neither AVX512-BF16 nor AMX (as torch reports it): there bf16
    matmuls are emulated, ~30x dearer than fp32 ones (a Zen 1 EPYC, docs/results/real_model.md).
    False where it has them or where this cannot be told (other architectures)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    checks = [getattr(torch.cpu, name, None)
              for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return None not in checks and not any(check() for check in checks)


def runs_on_cpu(cfg: RunConfig) -> bool:
    """Whether the run's device is the CPU (device cpu, or auto on a machine without CUDA)."""
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


def slow_bf16_warnings(cfg: RunConfig) -> list[str]:
    """A warning naming the run's fields set to bfloat16 when it runs on a CPU without bf16
    matmul units, with the overrides that turn them off; else none."""
    fields = {"model.dtype": cfg.model.dtype, "rollout.dtype": cfg.rollout.dtype,
              "grpo.autocast": cfg.grpo.autocast, "draft.autocast": cfg.draft.autocast}
    slow = [name for name, dtype in fields.items() if dtype == "bfloat16"]
    if not slow or not runs_on_cpu(cfg) or not cpu_lacks_bf16_matmul():
        return []
    off = " ".join(f"{n}=float32" if n.endswith("dtype") else f"{n}=" for n in slow)
    return [f"{', '.join(slow)} = bfloat16, but this CPU has no bf16 matmul units (no AVX512-BF16 "
            f"or AMX): bf16 matmuls run ~30x slower than fp32 here; add `{off}`"]
