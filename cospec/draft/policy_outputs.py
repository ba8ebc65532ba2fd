"""The policy's detached outputs over packed answers, for offline draft training: kept in memory,
or recomputed whenever a batch is read.

# T tokens in a packed batch, K tapped layers, C policy hidden size, Vd + 1 kept logit columns

Each offline training step reads one `TTTBatch`: packed answers (prompt + response) with the
policy's tapped features and logits at every position. Kept (``draft.keep_policy_outputs``, the
default), they cost one policy forward per batch up front and K C + Vd + 1 numbers a token held
for the whole run: ~40 KB a token for SmolLM2 (3 taps of 576, an 8192-id head in fp32), 11 GB for
2,048 of the recipe's answers (272,879 tokens with their prompts; the recipe's default 512 hold
~2.7 GB), so ~4,000 answers fill a 24 GB machine. Recomputed, a batch's forward runs each time training draws it: one batch in memory,
training starts at once, and each read costs a policy forward (what a kept batch saves from its
second read on). The forward is a pure function of the batch, so both give the same batches, and
on the same device and build the same draft (tests/test_policy_outputs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cospec.config import ConfigError
from cospec.data.packing import PackedBatch, pack_examples
from cospec.draft.losses import draft_targets
from cospec.draft.ttt import TTTBatch
from cospec.metrics.progress import progress_bar
from cospec.models.draft import default_tap_layers


def pack_answers(completions, tokens_per_batch: int) -> list[PackedBatch]:
    """The answers (prompt + response, the loss on the response) packed in order into batches of
    at most ``tokens_per_batch`` tokens (one longer answer makes a batch of its own)."""
    encoded = [(c.prompt + c.tokens, [0] * len(c.prompt) + [1] * len(c.tokens))
               for c in completions if c.tokens]
    batches, start = [], 0
    while start < len(encoded):
        used, end = 0, start
        while end < len(encoded) and (end == start or used + len(encoded[end][0]) - 1 <= tokens_per_batch):
            used += len(encoded[end][0]) - 1
            end += 1
        batches.append(pack_examples(encoded[start:end]))
        start = end
    return batches


class RecomputedBatches(Sequence):
    """`TTTBatch`es of packed answers whose policy forward runs when one is read: item i is batch
    i with the policy's detached taps and logits (kept as ``draft_targets`` keeps them: a reduced
    head's columns plus one bucket, at the sampling temperature). Holds no policy outputs."""

    def __init__(self, policy, packed: list[PackedBatch], tap_layers: tuple[int, ...],
                 vocab_ids: torch.Tensor | None, temperature: float):
        self.policy, self.packed, self.tap_layers = policy, packed, tuple(tap_layers)
        self.to_targets = draft_targets(vocab_ids, temperature)
        self.device = next(policy.parameters()).device

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i: int) -> TTTBatch:
        packed = self.packed[i]  # an IndexError here ends iteration, as a list's does
        with torch.no_grad():
            out = self.policy(packed.tokens.to(self.device), cu_seqlens=packed.cu_seqlens.to(self.device),
                              tap_layers=self.tap_layers)
        return TTTBatch(tokens=packed.tokens[0].to(self.device),
                        cu_seqlens=packed.cu_seqlens.to(self.device),
                        loss_mask=packed.loss_mask[0].to(self.device),
                        taps={k: v[0] for k, v in out.taps.items()},
                        policy_logits=self.to_targets(out.logits[0]))

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens.shape[1] for p in self.packed)


def policy_batches(cfg, policy, completions, *, vocab_ids: torch.Tensor | None = None,
                   keep: bool = True, progress: bool = False) -> Sequence[TTTBatch]:
    """The answers packed into batches of ~draft.tokens_per_batch tokens, each with the policy's
    detached taps and logits. With a reduced draft vocabulary the logits are kept as
    `compress_to_head` (at the sampling temperature, `draft_targets`): Vd + 1 numbers a token
    instead of V (SmolLM2: 4 GB of fp32 logits for 18K tokens otherwise). keep: compute every
    batch now and hold them (a list; an error after the first forward when they would not fit in
    the device's available memory), else `RecomputedBatches`."""
    taps = cfg.draft.tap_layers or default_tap_layers(policy.config.num_layers)
    lazy = RecomputedBatches(policy, pack_answers(completions, cfg.draft.tokens_per_batch), taps,
                             vocab_ids, cfg.sampling.temperature)
    if not keep:
        return lazy
    kept = []
    with progress_bar(progress, len(lazy), "policy forward") as advance:
        for i in range(len(lazy)):
            kept.append(lazy[i])
            if i == 0:
                check_room_for_kept_outputs(kept[0], lazy.num_tokens, lazy.device)
            advance()
    return kept


def num_tokens(batches: Sequence[TTTBatch]) -> int:
    """Tokens in the batches, without a forward where they are recomputed."""
    if isinstance(batches, RecomputedBatches):
        return batches.num_tokens
    return sum(int(b.tokens.numel()) for b in batches)


def check_room_for_kept_outputs(first: TTTBatch, tokens: int, device) -> None:
    """Raise, after the first batch's forward and before the others, if keeping the policy's
    outputs of ``tokens`` tokens, at the bytes a token of the ``first`` batch holds, would not fit
    in what the device has available."""
    held = [first.policy_logits, *first.taps.values()]
    per_token = sum(t.element_size() * t[0].numel() for t in held)
    need, available = per_token * tokens, available_memory(device)
    # A tenth left for what the run holds beside them: the draft, its optimizer state, the
    # held-out batches, one step's activations.
    if available is not None and need > 0.9 * available:
        raise ConfigError(
            f"draft.keep_policy_outputs: keeping the policy's taps and logits of {tokens:,} "
            f"tokens ({per_token / 1e3:.1f} KB a token) takes {need / 1e9:.1f} GB, and "
            f"{torch.device(device).type} has {available / 1e9:.1f} GB available: set "
            f"draft.keep_policy_outputs=false (each batch's policy forward recomputed when "
            f"training draws it, one batch in memory) or train on fewer answers")


def available_memory(device) -> int | None:
    """Bytes the device can still allocate; None where it cannot be told. CUDA: the free memory
    plus what torch's caching allocator holds unused (mem_get_info counts that as taken, and a
    trainer's rollouts leave GBs of it). The host: Linux's MemAvailable, or less where a cgroup
    (v2: a container's limit) allows less."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    limits = [_read_bytes("/proc/meminfo", "MemAvailable:")]
    cgroup_max = _read_bytes("/sys/fs/cgroup/memory.max")
    if cgroup_max is not None:
        limits.append(cgroup_max - (_read_bytes("/sys/fs/cgroup/memory.current") or 0))
    known = [x for x in limits if x is not None]
    return min(known) if known else None


def _read_bytes(path: str, field: str | None = None) -> int | None:
    """An integer from a kernel file: the whole file (cgroup's, in bytes; "max" is no limit), or
    the kB value of ``field`` in /proc/meminfo's layout."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if field is None:
        text = text.strip()
        return int(text) if text.isdigit() else None
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None
