"""Weight dtypes by name, and the mixed-precision context training forwards run in.

``grpo.autocast = "bfloat16"`` runs the policy step's forwards under `torch.autocast`: matmuls
in bf16, reductions, softmaxes and the losses (which upcast their logits explicitly) in fp32;
weights, gradients and optimizer state stay in ``model.dtype``. On CPUs with AMX this makes a
SmolLM2 forward + backward 2.4x faster (docs/results/real_model.md); on GPUs it is how RL
trainers run. The backward runs outside the context, as PyTorch recommends: it follows the
dtypes the forward recorded.

Draft training stays in fp32: under bf16 autocast the EAGLE-3 TTT loss did not learn
(teacher-forced acceptance 0.17 against 0.56 in fp32 after the same 80 steps on SmolLM2's samples).
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(dtype: str, device: torch.device | str):
    """torch.autocast on the device's type in ``dtype`` ("" = a no-op context)."""
    if not dtype:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])
