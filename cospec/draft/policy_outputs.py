"""The policy's detached outputs over packed answers, for offline draft training: kept in memory,
or recomputed whenever a batch is read.

# T tokens in a packed batch, K tapped layers, C policy hidden size, Vd ids in a reduced head

Each offline training step reads one `TTTBatch`: packed answers (prompt + response) with the
policy's tapped features and logits at every position. Kept (``draft.keep_policy_outputs``, the
default), they cost one policy forward per batch up front and are held for the whole run;
recomputed, a batch's forward runs each time training draws it: one batch in memory, training
starts at once, and each read costs a policy forward (what a kept batch saves from its second
read on).

What is kept of a position with a reduced draft head is not its Vd + 1 target logits
(`compress_to_head`) but what they are computed from: the policy's final normed hidden state (C
numbers) and the bucket logit (one), from which a read computes the head's Vd columns with one
matmul against those rows of the policy's head (`PolicyHeadRows`; where Vd > C, else the
logits are the fewer numbers and are kept). K C + C + 1 numbers a token instead of K C + Vd + 1:
for SmolLM2 (3 taps of 576, an 8192-id head, fp32) 9.2 KB instead of 39.7 KB, so the outputs over
4,096 of the recipe's answers (~550K tokens with their prompts) take ~5 GB instead of ~22 GB. The
read's matmul is T x C x Vd (6 GFLOP for a 640-token batch), a fraction of the draft's own step.
Without a reduced head the logits are kept as they are.

The policy's forward runs under ``draft.autocast``: in bf16 there, as the rollouts' bf16 policy
and the GRPO step's forward compute the p the draft meets (with a `PolicyHeadRows` the head's
columns are then an fp32 matmul over that forward's hidden state, the bucket its bf16 logits').
On an AMX CPU a recomputed SmolLM2 batch of ~640 tokens reads in 0.39 s instead of 0.61-0.64 s
in fp32, and the 8,192-answer draft's expected tau on 512 held-out answers reads 2.587 against
targets computed either way (docs/results/real_model.md).

Kept and recomputed batches go through the same read (`KeptOutputs.batch`), so they give the same
batches bit for bit and, on the same device and build, the same draft (tests/test_policy_outputs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from cospec.config import ConfigError
from cospec.data.packing import PackedBatch, pack_examples
from cospec.draft.losses import bucket_logit, draft_targets
from cospec.draft.ttt import TTTBatch
from cospec.metrics.progress import progress_bar
from cospec.models.draft import default_tap_layers
from cospec.models.llama import MASKED_LOGIT
from cospec.models.precision import autocast


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


class PolicyHeadRows:
    """The rows of the policy's head for a reduced draft vocabulary's ids: turns kept final normed
    hidden states [T, C] and bucket logits [T, 1] back into `compress_to_head`'s [T, Vd + 1]
    (equal to it up to the rounding of a matmul over Vd rows instead of V). Holds a copy of the
    head's Vd rows (18.9 MB for SmolLM2's 8192 x 576 in fp32)."""

    def __init__(self, policy, vocab_ids: Tensor, temperature: float):
        self.norm, self.temperature = policy.norm, temperature
        self.vocab_ids = vocab_ids.to(policy.lm_head.weight.device)
        self.rows = policy.lm_head.weight.detach()[self.vocab_ids]  # indexing copies
        # ids past the sampled vocabulary carry MASKED_LOGIT, as in the forward (decided here,
        # once: a check per read would be a device sync per training step on CUDA)
        sampled = policy.sampled_vocab_size
        masked = None if sampled is None else self.vocab_ids >= sampled
        self.masked = masked if masked is not None and bool(masked.any()) else None

    @torch.no_grad()
    def split(self, hidden_TC: Tensor, logits_TV: Tensor) -> tuple[Tensor, Tensor]:
        """(normed hidden [T, C], bucket [T, 1]) of a forward's final hidden state and logits;
        the normed state in the head's dtype, whatever autocast the forward ran under."""
        return (self.norm(hidden_TC).to(self.rows.dtype),
                bucket_logit(logits_TV, self.vocab_ids, self.temperature))

    @torch.no_grad()
    def logits(self, normed_TC: Tensor, bucket_T1: Tensor) -> Tensor:
        cols = F.linear(normed_TC, self.rows)
        if self.masked is not None:
            cols = cols.masked_fill(self.masked, MASKED_LOGIT)
        return torch.cat([cols.to(bucket_T1.dtype), bucket_T1], dim=-1)


@dataclasses.dataclass
class KeptOutputs:
    """A packed batch with what is kept of the policy's forward over it: the taps and either the
    target logits as the losses read them, or (with a `PolicyHeadRows`) normed hidden and bucket."""

    packed: PackedBatch
    taps: dict[int, Tensor]
    logits: Tensor | None = None
    normed: Tensor | None = None
    bucket: Tensor | None = None

    def held(self) -> list[Tensor]:
        return [t for t in (self.logits, self.normed, self.bucket, *self.taps.values()) if t is not None]

    def batch(self, head: PolicyHeadRows | None, device) -> TTTBatch:
        p = self.packed
        return TTTBatch(tokens=p.tokens[0].to(device), cu_seqlens=p.cu_seqlens.to(device),
                        loss_mask=p.loss_mask[0].to(device), taps=self.taps,
                        policy_logits=(self.logits if head is None
                                       else head.logits(self.normed, self.bucket)))


class RecomputedBatches(Sequence):
    """`TTTBatch`es of packed answers whose policy forward runs when one is read: item i is batch
    i with the policy's detached taps and logits (kept as ``draft_targets`` keeps them: a reduced
    head's columns plus one bucket, at the sampling temperature). Holds no policy outputs.
    `kept_outputs` gives what a kept batch holds instead. (With a `PolicyHeadRows` it holds
    that copy of the head's rows.)"""

    def __init__(self, policy, packed: list[PackedBatch], tap_layers: tuple[int, ...],
                 vocab_ids: torch.Tensor | None, temperature: float, autocast_dtype: str = ""):
        self.policy, self.packed, self.tap_layers = policy, packed, tuple(tap_layers)
        self.autocast_dtype = autocast_dtype
        self.to_targets = draft_targets(vocab_ids, temperature)
        # The hidden state and a bucket (C + 1 numbers) only where they are fewer than the
        # head's Vd + 1 logits: SmolLM2's 576 against 8193; not a toy's 64 against 13.
        self.head = (PolicyHeadRows(policy, vocab_ids, temperature)
                     if vocab_ids is not None and len(vocab_ids) > policy.config.hidden_size else None)
        self.device = next(policy.parameters()).device

    def __len__(self) -> int:
        return len(self.packed)

    def kept_outputs(self, i: int) -> KeptOutputs:
        """Batch i's policy forward, reduced to what keeping it holds."""
        packed = self.packed[i]  # an IndexError here ends iteration, as a list's does
        with torch.no_grad(), autocast(self.autocast_dtype, self.device):
            out = self.policy(packed.tokens.to(self.device), cu_seqlens=packed.cu_seqlens.to(self.device),
                              tap_layers=self.tap_layers)
        taps = {k: v[0] for k, v in out.taps.items()}
        if self.head is None:
            return KeptOutputs(packed, taps, logits=self.to_targets(out.logits[0]))
        normed, bucket = self.head.split(out.hidden[0], out.logits[0])
        return KeptOutputs(packed, taps, normed=normed, bucket=bucket)

    def __getitem__(self, i: int) -> TTTBatch:
        return self.kept_outputs(i).batch(self.head, self.device)

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens.shape[1] for p in self.packed)


class KeptBatches(Sequence):
    """The batches with their policy outputs computed once and held (`KeptOutputs`); a read
    builds the `TTTBatch` (with a reduced head: one matmul for its target logits). A slice is
    a `KeptBatches` of those batches."""

    def __init__(self, outputs: list[KeptOutputs], head: PolicyHeadRows | None, device):
        self.outputs, self.head, self.device = outputs, head, device

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return KeptBatches(self.outputs[i], self.head, self.device)
        return self.outputs[i].batch(self.head, self.device)

    @property
    def num_tokens(self) -> int:
        return sum(o.packed.tokens.shape[1] for o in self.outputs)


def policy_batches(cfg, policy, completions, *, vocab_ids: torch.Tensor | None = None,
                   keep: bool = True, progress: bool = False) -> Sequence[TTTBatch]:
    """The answers packed into batches of ~draft.tokens_per_batch tokens, each with the policy's
    detached taps and logits. With a reduced draft vocabulary the logits read as
    `compress_to_head`'s (at the sampling temperature, `draft_targets`): Vd + 1 numbers a token
    instead of V (SmolLM2: 4 GB of fp32 logits for 18K tokens otherwise). keep: compute every
    batch now and hold them (`KeptBatches`; an error after the first forward when they would not
    fit in the device's available memory), else `RecomputedBatches`. The policy's forward runs
    under draft.autocast, as the draft's own training forwards do."""
    taps = cfg.draft.tap_layers or default_tap_layers(policy.config.num_layers)
    lazy = RecomputedBatches(policy, pack_answers(completions, cfg.draft.tokens_per_batch), taps,
                             vocab_ids, cfg.sampling.temperature, cfg.draft.autocast)
    if not keep:
        return lazy
    outputs = []
    with progress_bar(progress, len(lazy), "policy forward") as advance:
        for i in range(len(lazy)):
            outputs.append(lazy.kept_outputs(i))
            if i == 0:
                check_room_for_kept_outputs(outputs[0], lazy.num_tokens, lazy.device)
            advance()
    return KeptBatches(outputs, lazy.head, lazy.device)


def num_tokens(batches: Sequence[TTTBatch]) -> int:
    """Tokens in the batches, without a forward where they are recomputed."""
    if isinstance(batches, (RecomputedBatches, KeptBatches)):
        return batches.num_tokens
    return sum(int(b.tokens.numel()) for b in batches)


def check_room_for_kept_outputs(first: KeptOutputs, tokens: int, device) -> None:
    """Raise, after the first batch's forward and before the others, if keeping the policy's
    outputs of ``tokens`` tokens, at the bytes a token of the ``first`` batch holds, would not fit
    in what the device has available."""
    per_token = kept_bytes_per_token(first)
    need, available = per_token * tokens, available_memory(device)
    # A tenth left for what the run holds beside them: the draft, its optimizer state, the
    # held-out batches, one step's activations.
    if available is not None and need > 0.9 * available:
        raise ConfigError(
            f"draft.keep_policy_outputs: keeping the policy's outputs over {tokens:,} "
            f"tokens ({per_token / 1e3:.1f} KB a token) takes {need / 1e9:.1f} GB, and "
            f"{torch.device(device).type} has {available / 1e9:.1f} GB available: set "
            f"draft.keep_policy_outputs=false (each batch's policy forward recomputed when "
            f"training draws it, one batch in memory) or train on fewer answers")


def kept_bytes_per_token(outputs: KeptOutputs) -> int:
    """What keeping one position of a batch's policy outputs holds, in bytes."""
    return sum(t.element_size() * t[0].numel() for t in outputs.held())


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
