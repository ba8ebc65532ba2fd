"""Specification of cospec.parallel.zigzag: the zigzag plan of a packed row is exact and balanced.

Single process (the plan is arithmetic); the all-gather in `ZigzagLayout.gather` is exercised by the
policy parity test in test_ring_attention.py. Everything here is exact integer bookkeeping: any
mismatch is a bug in the index maps, printed as the offending rank and tokens.
"""

import pytest
import torch

from cospec.parallel.zigzag import ZigzagLayout, causal_pairs_per_rank

LENGTHS = [(16,), (13, 3, 1, 8), (5, 2), (40, 7, 1)]


def _layout(lengths, cp):
    return ZigzagLayout.build(torch.tensor([0, *lengths]).cumsum(0), cp)


def test_docstring_example_cp2_lengths_5_and_2():
    z = _layout((5, 2), 2)
    assert z.padded_cu_seqlens.tolist() == [0, 8, 12]
    assert z.local_index(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert z.local_index(1).tolist() == [2, 3, 4, 5, 9, 10]
    assert z.local_cu_seqlens().tolist() == [0, 4, 6]
    assert z.local_positions(1).tolist() == [2, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_shard_then_unshard_is_the_identity(lengths, cp):
    z = _layout(lengths, cp)
    x = torch.randn(3, z.num_tokens, 2)
    shards = [z.shard(x, r, dim=1, value=float("nan")) for r in range(cp)]
    assert all(s.shape == (3, z.num_local, 2) for s in shards)
    assert torch.equal(z.unshard(shards, dim=1), x)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_every_padded_token_is_on_exactly_one_rank_with_its_position(lengths, cp):
    z = _layout(lengths, cp)
    held = torch.cat([z.local_index(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(z.num_padded))
    for r in range(cp):  # positions restart per sequence and increase within each local sequence
        pos, cu = z.local_positions(r), z.local_cu_seqlens()
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert bool((pos[a + 1:b] > pos[a:b - 1]).all()), f"rank {r}: {pos[a:b].tolist()}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_causal_work_is_equal_on_every_rank(lengths, cp):
    """Chunks r and 2cp-1-r sum to the same number of (query, key <= query) pairs."""
    counts = causal_pairs_per_rank(_layout(lengths, cp))
    assert len(set(counts)) == 1, counts


def test_a_plain_split_would_not_be_balanced():
    """The check above can fail: contiguous halves of a 16-token sequence give 36 vs 100 pairs."""
    pos = torch.arange(16)
    assert int((pos[:8] + 1).sum()) != int((pos[8:] + 1).sum())


def test_padding_carries_the_given_value_and_real_tokens_stay_in_order():
    z = _layout((5, 2), 2)
    labels = torch.arange(7)
    assert z.shard(labels, 0, value=-100).tolist() == [0, 1, -100, -100, 5, -100]


@pytest.mark.parametrize("cu,match", [
    ([0, 4, 4, 9], "strictly increase"),
    ([1, 5], "start at 0"),
    ([[0, 3]], "1-D"),
])
def test_malformed_cu_seqlens_is_a_clear_error(cu, match):
    with pytest.raises(ValueError, match=match):
        ZigzagLayout.build(torch.tensor(cu), 2)


def test_wrong_token_count_and_wrong_shard_count_are_clear_errors():
    z = _layout((5, 2), 2)
    with pytest.raises(ValueError, match="6 tokens, the packed row has 7"):
        z.shard(torch.zeros(6), 0)
    with pytest.raises(ValueError, match="needs 2 shards"):
        z.unshard([torch.zeros(6)])
    with pytest.raises(ValueError, match="rank 2 out of range"):
        z.local_index(2)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        ZigzagLayout.build(torch.tensor([0, 3]), 0)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_a_shard_of_chosen_sequences_is_those_rows_of_the_whole_rows_shard(cp):
    """`ZigzagLayout.select`: what a gather of the chosen sequences alone reads of each rank."""
    from cospec.data.packing import sequence_rows

    cu = torch.tensor([0, 5, 7, 19, 20, 31])
    layout, chosen = ZigzagLayout.build(cu, cp), [1, 2, 4]
    x = torch.arange(31.0)[:, None] * torch.tensor([1.0, -1.0])  # [T, 2]: every row distinct
    sub, rows = layout.select(chosen)
    assert sub.cu_seqlens.tolist() == [0, 2, 14, 25]
    for r in range(cp):
        assert torch.equal(sub.shard(x[sequence_rows(cu, chosen)], r, dim=0),
                           layout.shard(x, r, dim=0)[rows])
