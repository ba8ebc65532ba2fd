"""Random numbers per prompt: a rollout's tokens depend on its own seed, not on its batch.

# B engine slots, U uniforms a row may draw, N rows drawing now

With one `torch.Generator` for the whole batch, which numbers a row draws depends on which rows
share its batch and in which slot it sits, so the same prompt answered by another rank (data
parallel rollouts), in a smaller batch or after a refill order change gets other tokens. With
`PromptStreams` each prompt brings a seed; when it enters a slot, that slot's row of a table is
filled with the first U uniforms of a CPU generator seeded with it (torch's own generator, so the
numbers are as good as `torch.rand`'s), and every draw of the row reads the next entries of its
row. A row never draws more than U numbers: the engine says how many it may draw per emitted token
(`draws_per_token`: 1 for plain decoding, 2 gamma + 1 for a speculative step: gamma draft tokens,
gamma acceptance tests, one corrected or bonus token), and a row emits at most max_new_tokens.

The draws stay on the device and take no host sync: a draw of k numbers for the N bound rows is a
gather at each row's counter and a counter increment (a handful of small ops: about 2% of a
plain decode step at batch 16 on the default model, measured in docs/results/rollout.md).

Why the sampling stays exact: docs/design.md, "Per-prompt random streams". The tokens are then a
function of (prompt, seed, policy) alone, up to the floating-point differences that another batch
shape can cause in the forward (a different matmul blocking moves a logit by an ulp, which changes
a token only when a uniform falls within that ulp of a boundary of the inverse CDF).
"""

from __future__ import annotations

import torch
from torch import Tensor


class PromptStreams:
    """One stream of uniforms per engine slot, reset from the prompt's seed when a prompt enters.

    The engine calls `assign` at a refill and `bind` before every draw with the rows that draw;
    the samplers call `uniform` where they would call `torch.rand` (`cospec.rollout.sampling.
    uniform`)."""

    def __init__(self, seeds: list[int], batch_size: int, draws_per_row: int, device):
        self.seeds = list(seeds)
        self.draws_per_row = draws_per_row
        self.table_BU = torch.empty(batch_size, draws_per_row, dtype=torch.float64, device=device)
        self.count_B = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.rows_N: Tensor | None = None  # None: every slot, in order
        self._arange = torch.arange(max(draws_per_row, 1), device=device)
        self.peak = torch.zeros((), dtype=torch.long, device=device)  # most numbers a row asked for

    def assign(self, slots: list[int], prompt_indices: list[int]) -> None:
        """Slots ``slots`` now answer prompts ``prompt_indices``: their streams restart."""
        table = torch.empty(len(slots), self.draws_per_row, dtype=torch.float64)
        for j, i in enumerate(prompt_indices):
            gen = torch.Generator().manual_seed(self.seeds[i])
            table[j] = torch.rand(self.draws_per_row, dtype=torch.float64, generator=gen)
        rows = torch.tensor(slots, device=self.table_BU.device)
        self.table_BU[rows] = table.to(self.table_BU.device, non_blocking=True)
        self.count_B[rows] = 0

    def bind(self, rows_N: Tensor | None) -> None:
        """The slots whose draws come next, in the order of the sampled rows (None: all slots)."""
        self.rows_N = None if rows_N is None or len(rows_N) == self.count_B.shape[0] else rows_N

    def uniform(self, n: int, k: int) -> Tensor:
        """float64 [n, k] in [0, 1): k numbers for each of n sampled rows. n is a multiple m of the
        bound rows (m draws of one row are consecutive, as `reshape(N * m, -1)` lays them out);
        each bound row reads its next m * k numbers."""
        rows = self.rows_N
        count = self.count_B if rows is None else self.count_B[rows]
        bound = count.shape[0]
        if n % bound:
            raise ValueError(f"{n} sampled rows for {bound} bound slots: bind the drawing rows first")
        width = n // bound * k
        idx_NW = count[:, None] + self._arange[:width]
        table = self.table_BU if rows is None else self.table_BU[rows]
        u = table.gather(1, idx_NW.clamp(max=self.draws_per_row - 1))
        self.peak = torch.maximum(self.peak, (count + width).max())
        if rows is None:
            self.count_B += width
        else:
            self.count_B[rows] = count + width
        return u.reshape(n, k)

    def check_bound(self) -> None:
        """RuntimeError if a row asked for more numbers than its table holds (then it re-read its
        last one, and its tokens were not properly random); one host read, once per generate call."""
        peak = int(self.peak)
        if peak > self.draws_per_row:
            raise RuntimeError(f"a rollout drew {peak} random numbers but its stream holds "
                               f"{self.draws_per_row}: the engine's draws_per_token is too low")


def rollout_seed(seed: int, step: int, k: int) -> int:
    """The seed of rollout k (step-wide index) of GRPO step ``step`` (0-based): distinct for
    every (step, k) of a run, whichever replica answers it."""
    return ((seed * 1_000_003 + step) * 1_000_033 + k) % 2 ** 63
