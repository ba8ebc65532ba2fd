"""Weight dtypes by name, and the mixed-precision context training forwards run in.

``grpo.autocast = "bfloat16"`` runs the policy step's forwards under `torch.autocast` (and
``draft.autocast`` the draft's training forwards): matmuls in bf16, reductions, softmaxes and the
losses (which upcast their logits explicitly) in fp32; weights, gradients and optimizer state
stay in ``model.dtype``. On CPUs with AMX this makes a SmolLM2 forward + backward 2.4x faster
(docs/results/real_model.md); on GPUs it is how RL trainers run. The backward runs outside the context, as PyTorch recommends: it follows the
dtypes the forward recorded.

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

import torch

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
