"""Static-shape KV cache whose rows keep their own lengths (a ragged batch).

# L layers, B rows, Hkv key/value heads, S capacity (slots), D head dim, T new tokens

Buffers are allocated once, one key and one value tensor [B, Hkv, S, D] per layer (``keys[i]``,
``values[i]``), and registered, so ``.to(device)`` moves them and no step allocates. One tensor per
layer rather than one [L, B, Hkv, S, D] block: a compiled forward
(`cospec.rollout.compiled_forward`) that writes a slice of one shared block copies the whole block
per layer (measured 3x slower than eager on the default policy), while a write into a layer's own
tensor stays in place.

``lengths_B[b]`` is the number of valid slots of row b; slots past it hold stale values that the
attention mask hides, so rolling a row back (speculative rejection) is just lowering its length:
`truncate`.

A forward with the cache writes the T new tokens of each row at slots lengths_b .. lengths_b+T-1 of
every layer, then `advance` adds each row's count of *valid* new tokens (a right-padded prefill of
rows with different prompt lengths passes ``num_valid_B``).

Host reads: a forward must know, on the host, how many slots its attention covers (a shape), which
would read ``lengths_B`` back from the device every forward. A caller that knows its rows' lengths
on the host (the engines do: they record every token) says so first with `expect_longest`, and
the next `check_room` uses that instead of the device read. Without it (calibration, tests, any
other caller) `check_room` reads the lengths, as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, layer_ids: list[int] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.capacity = capacity
        self.batch_size = batch_size
        # A pipeline stage holds a subset of layers: map the global layer id to its buffer index.
        ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
        assert len(ids) == num_layers, "layer_ids must name one id per cached layer"
        self.slot_of_layer = {lid: i for i, lid in enumerate(ids)}
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        for i in range(num_layers):
            self.register_buffer(f"k_{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
        self.num_layers = num_layers
        self.register_buffer("lengths_B", torch.zeros(batch_size, dtype=torch.long, device=device),
                             persistent=False)
        self._longest_hint: int | None = None  # see `expect_longest`

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None) -> "KVCache":
        cfg = model.config
        p = next(model.parameters())
        return cls(num_layers=len(model.layers), batch_size=batch_size,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   capacity=capacity or cfg.max_seq_len,
                   layer_ids=[int(i) for i in model.layers.keys()], dtype=p.dtype, device=p.device)

    @property
    def keys(self) -> list[Tensor]:
        """[B, Hkv, S, D] per cached layer, in buffer order (`slot_of_layer`)."""
        return [getattr(self, f"k_{i}") for i in range(self.num_layers)]

    @property
    def values(self) -> list[Tensor]:
        return [getattr(self, f"v_{i}") for i in range(self.num_layers)]

    def _rows(self, rows: Tensor | None) -> Tensor:
        if rows is None:
            return torch.arange(self.batch_size, device=self.lengths_B.device)
        return rows

    def expect_longest(self, length: int) -> None:
        """The caller knows (on the host) that no row the next forward addresses is longer than
        `length` before it writes: the next `check_room` takes that instead of reading the device."""
        self._longest_hint = length

    def check_room(self, num_new: int, rows: Tensor | None = None) -> int:
        """The longest addressed row after writing num_new tokens (the slots attention must cover);
        ValueError if that overflows the capacity. One device read unless `expect_longest` said."""
        if self._longest_hint is not None:
            longest, self._longest_hint = self._longest_hint + num_new, None
        else:
            longest = int(self.lengths_B[self._rows(rows)].max()) + num_new  # device sync
        if longest > self.capacity:
            raise ValueError(f"KV cache overflow: a row would reach {longest} tokens, capacity is "
                             f"{self.capacity} (model.max_seq_len)")
        return longest

    def update(self, layer_id: int, k_BHTD: Tensor, v_BHTD: Tensor, rows: Tensor | None,
               used: int) -> tuple[Tensor, Tensor]:
        """Write the new keys/values of `rows` and return their cache view [B, Hkv, used, D]."""
        slot = self.slot_of_layer[layer_id]
        k_BHSD, v_BHSD = getattr(self, f"k_{slot}"), getattr(self, f"v_{slot}")
        num_new = k_BHTD.shape[2]
        r = self._rows(rows)
        pos_BT = self.lengths_B[r][:, None] + torch.arange(num_new, device=r.device)[None, :]
        # Advanced indexing on (row, slot) puts those dims first: the value is [B, T, Hkv, D].
        k_BHSD[r[:, None], :, pos_BT] = k_BHTD.transpose(1, 2).to(k_BHSD.dtype)
        v_BHSD[r[:, None], :, pos_BT] = v_BHTD.transpose(1, 2).to(v_BHSD.dtype)
        if rows is None:  # a view, no copy: the decode hot path
            return k_BHSD[:, :, :used], v_BHSD[:, :, :used]
        return k_BHSD[r, :, :used], v_BHSD[r, :, :used]

    def advance(self, num_valid_B: Tensor | int, rows: Tensor | None = None) -> None:
        r = self._rows(rows)
        self.lengths_B[r] += num_valid_B

    def truncate(self, new_lengths_B: Tensor, rows: Tensor | None = None) -> None:
        """Roll rows back to `new_lengths_B` (never forward: stale slots are not valid)."""
        r = self._rows(rows)
        # Checked without a host read (on CUDA the assert fires asynchronously)
        torch._assert_async((new_lengths_B <= self.lengths_B[r]).all(), "truncate cannot grow a row")
        self.lengths_B[r] = new_lengths_B

    def reset(self, rows: Tensor | None = None) -> None:
        self.lengths_B[self._rows(rows)] = 0
