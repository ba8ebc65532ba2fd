"""Packed random answers with a policy's outputs, as offline draft training keeps them, for tests
of what is computed on fixed answers. Import with ``from ttt_answers import packed_answers``
(pytest puts tests/ on sys.path).
"""

import torch

from cospec.draft.ttt import TTTBatch


def packed_answers(policy, tap_layers, lengths: list[int], prompt_lengths: list[int], *,
                   seed: int) -> TTTBatch:
    """Random answers of ``lengths`` tokens (ids 4.., past the special ones), the first
    ``prompt_lengths`` of each a prompt: entry t is trained where token t + 1 is a response token."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, policy.config.vocab_size, (sum(lengths),), generator=gen)
    cu = torch.tensor([0] + lengths).cumsum(0)
    mask = torch.zeros(len(tokens))
    for start, end, p in zip(cu[:-1].tolist(), cu[1:].tolist(), prompt_lengths):
        mask[start + p - 1:end] = 1
    with torch.no_grad():
        out = policy(tokens[None], cu_seqlens=cu, tap_layers=tuple(tap_layers))
    return TTTBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask,
                    taps={k: v[0] for k, v in out.taps.items()}, policy_logits=out.logits[0])
