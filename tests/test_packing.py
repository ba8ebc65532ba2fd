"""Specification of cospec.data.packing: packed rows, and their cuts into balanced microbatches."""

import itertools

import pytest
import torch

from cospec.data.packing import balanced_cuts, pack_examples


def cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)])


def test_packing_never_predicts_across_an_example_boundary():
    packed = pack_examples([([1, 5, 6, 2], [0, 0, 1, 1]), ([1, 7, 2], [0, 0, 1])])
    assert packed.tokens.tolist() == [[1, 5, 6, 1, 7]]
    assert packed.targets.tolist() == [[5, 6, 2, 7, 2]]
    assert packed.loss_mask.tolist() == [[0, 1, 1, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5]


def test_a_cut_is_the_boundary_nearest_to_an_equal_share():
    assert balanced_cuts(cu([36, 43, 45, 43]), 2) == [0, 2, 4]  # 79 | 88, not 124 | 43
    assert balanced_cuts(cu([10, 10, 10, 10]), 2) == [0, 2, 4]
    assert balanced_cuts(cu([10, 10, 10, 10]), 4) == [0, 1, 2, 3, 4]
    assert balanced_cuts(cu([10, 20, 10]), 2) == [0, 1, 3]  # a tie (10 | 30, 30 | 10): the earlier


@pytest.mark.parametrize("lengths,parts", [([100, 1, 1, 1], 3), ([1, 1, 1, 100], 3),
                                           ([5], 1), ([3, 9, 4, 4, 8, 1, 7], 4)])
def test_every_piece_has_a_sequence_and_the_largest_is_within_a_sequence_of_the_best_cut(lengths, parts):
    cuts = balanced_cuts(cu(lengths), parts)
    assert cuts[0] == 0 and cuts[-1] == len(lengths)
    assert all(a < b for a, b in zip(cuts[:-1], cuts[1:]))
    largest = max(sum(lengths[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))
    # the oracle: every way to cut the row into ``parts`` non-empty pieces
    best = min(max(sum(lengths[a:b]) for a, b in zip((0, *c), (*c, len(lengths))))
               for c in itertools.combinations(range(1, len(lengths)), parts - 1))
    assert largest <= best + max(lengths)


def test_more_pieces_than_sequences_is_refused():
    with pytest.raises(ValueError, match="cannot split 2 sequences into 3 microbatches"):
        balanced_cuts(cu([4, 4]), 3)
