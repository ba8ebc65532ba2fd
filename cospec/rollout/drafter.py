"""The one small interface between the speculative engine and a draft.

# N rows addressed, T entries per row, C hidden size, V vocab

The drafts index a sequence s_0 s_1 ... by *entry*: entry t holds token s_t (and, for EAGLE-3, the
projected policy feature of position t - 1, zeros at t = 0; see `cospec.models.draft`), sits at
position t of the draft's own KV cache, and its logits predict s_{t+1}. The engine keeps, per cache
row, the token history and the feature history aligned by entry, feeds every entry the draft has not
seen yet in one call ("catch-up", ragged across rows), then one entry per further draft step.

A drafter:
- ``tap_layers``: the policy layers whose outputs the verify pass must return (empty: none);
- ``feature_size``: width of the stored per-entry feature (0: the draft reads none);
- ``features(taps)``: policy taps [N, T, C] per layer -> stored per-entry features [N, T, F] (or
  None): for EAGLE-3 the taps side by side, F = 3C, *not yet projected*;
- ``project(stored)``: stored features [N, T, F] -> what the draft reads [N, T, C]. Apart from
  `features` because most verified positions are never fed to the draft (rejected drafts) or not
  soon (steps at gamma 0): the projection (a 3C x C matmul per entry, ~6% of the embedded policy's
  forward) runs at catch-up, on the entries the draft reads, once each;
- ``new_cache(batch_size, capacity)``: the draft's own KV cache;
- ``vocab_ids``: the policy ids of the draft head's columns (EAGLE-3's reduced draft vocabulary),
  or None when the head covers the whole vocabulary; q is zero off the head;
- ``parallel``: False for the autoregressive drafters (EAGLE-3, a draft LM), which offer
  ``__call__(cache, tokens_NT, feats_NTF, rows_N, num_valid_N)`` -> (logits [N, T, Vd], state
  [N, T, C] or None): feed T entries per row; logits over the head's columns (a tapped draft's
  times its ``proposal_scale``: what the engine draws from, `proposal_logits`); ``feats`` is the
  stored feature for catch-up entries and the previous step's ``state`` for further draft steps.
  True for the block drafter (`BlockDrafter`), whose catch-up writes only context and whose one
  forward proposes the whole block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cospec.config import SamplingConfig
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft, TappedDraft
from cospec.models.llama import Transformer
from cospec.rollout.kv_cache import KVCache
from cospec.rollout.sampling import probs_from_logits, sample


class TappedDrafter:
    """What the drafters of a `TappedDraft` share: the taps stored raw, projected at catch-up."""

    def __init__(self, draft: TappedDraft, policy_cfg=None):
        if policy_cfg is not None:
            draft.check_policy(policy_cfg)
        # forward: what the steps call (a compiled forward under `SpeculativeEngine(compile=True)`)
        self.model = self.forward = draft
        self.tap_layers = draft.tap_layers
        self.feature_size = len(draft.tap_layers) * draft.policy_config.hidden_size
        self.vocab_ids = draft.vocab_ids

    def features(self, taps: dict[int, Tensor]) -> Tensor:
        return self.model.concat_taps(taps)

    def project(self, stored_NTF: Tensor) -> Tensor:
        return self.model.fc(stored_NTF)

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache.for_model(self.model, batch_size, capacity)


class Eagle3Drafter(TappedDrafter):
    """EAGLE-3: first step on the policy's features, later steps on the draft's own hidden."""

    parallel = False  # drafts one token per call (a block drafter: `BlockDrafter`)

    def __call__(self, cache: KVCache, tokens_NT: Tensor, feats_NTC: Tensor, rows_N: Tensor | None,
                 num_valid_N: Tensor | None = None, logits_positions_N: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        """Logits [N, T, Vd] (at ``logits_positions_N`` only: [N, 1, Vd]) and hidden [N, T, C]."""
        out = self.forward(tokens_NT, feats_NTC, kv_cache=cache, cache_rows=rows_N,
                           num_valid_B=num_valid_N, logits_positions_B=logits_positions_N)
        # Over the head's columns only: the engine warps and draws there and maps the draws to
        # policy ids; the ids off the head have q = 0, so the residual max(0, p - q) keeps their
        # exact p (`cospec.rollout.verify.HeadProbs`).
        return proposal_logits(self.model, out.logits), out.hidden


class LMDrafter:
    """A standalone small causal LM (the "draft model" method of vLLM and HF assisted generation)."""

    tap_layers: tuple[int, ...] = ()
    parallel = False
    feature_size = 0
    vocab_ids = None

    def __init__(self, lm: Transformer, policy_cfg=None):
        if policy_cfg is not None and lm.config.vocab_size != policy_cfg.vocab_size:
            raise ValueError(f"draft/policy mismatch: draft LM has vocab_size={lm.config.vocab_size}, "
                             f"policy has vocab_size={policy_cfg.vocab_size}")
        # forward: what the steps call (a compiled forward under `SpeculativeEngine(compile=True)`)
        self.model = self.forward = lm

    def features(self, taps: dict[int, Tensor]) -> None:
        return None

    def project(self, stored: None) -> None:
        return None

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache.for_model(self.model, batch_size, capacity)

    def __call__(self, cache: KVCache, tokens_NT: Tensor, feats_NTC: Tensor | None,
                 rows_N: Tensor | None, num_valid_N: Tensor | None = None,
                 logits_positions_N: Tensor | None = None) -> tuple[Tensor, None]:
        out = self.forward(tokens_NT, kv_cache=cache, cache_rows=rows_N, num_valid_B=num_valid_N,
                           logits_positions_B=logits_positions_N)
        return out.logits, None


class BlockDrafter(TappedDrafter):
    """The block draft (`cospec.models.block_draft`): a catch-up, one forward, then the heads.

    ``parallel = True``: instead of the autoregressive ``__call__`` it offers
    - ``add_context(cache, feats_NWC, rows, width_N)``: entries e..n of each row into the draft's
      cache, keys and values only (no query, no logits: two projections a layer);
    - ``draft(cache, anchor_N, gamma, rows, sampling, generator)``: one forward of the block
      [s_n, mask x (gamma - 1)] and the draws of its gamma tokens, each from q_i over the head's
      columns. With the sequential correction, position i's logits depend on the token drawn at
      i - 1, so the heads run one position at a time (a C x C matmul and the head each); without
      it all gamma positions are warped and drawn at once. Returns the drafts in policy ids
      [N, G], q [N, G, Vd], and the confidence [N, G] (None without the head), which the
      adaptive controller turns into a verify length (`AdaptiveGamma.verify_length`).
    """

    parallel = True

    def add_context(self, cache: KVCache, feats_NWC: Tensor, rows_N: Tensor | None,
                    width_N: Tensor | int) -> None:
        self.model.add_context(cache, feats_NWC, rows_N, width_N)

    def draft(self, cache: KVCache, anchor_N: Tensor, gamma: int, rows_N: Tensor | None,
              sampling: SamplingConfig, generator: torch.Generator | None
              ) -> tuple[Tensor, Tensor, Tensor | None]:
        m, ids = self.model, self.vocab_ids
        hidden_NGC = m.propose(cache, anchor_N, gamma, rows_N)
        warp = (sampling.temperature, sampling.top_k, sampling.top_p)
        if not m.has_correction:
            N = hidden_NGC.shape[0]
            q_NGV = probs_from_logits(proposal_logits(m, m.logits(hidden_NGC)), *warp)
            x = sample(q_NGV.reshape(N * gamma, -1), generator).view(N, gamma)
            conf = m.confidence(hidden_NGC)
            return (x if ids is None else ids[x]), q_NGV, conf
        prev, drafts, qs, confs = anchor_N, [], [], []
        for i in range(gamma):
            h = m.corrected(hidden_NGC[:, i], prev)
            q_NV = probs_from_logits(proposal_logits(m, m.logits(h)), *warp)
            x_N = sample(q_NV, generator)
            prev = x_N if ids is None else ids[x_N]
            drafts.append(prev)
            qs.append(q_NV)
            confs.append(m.confidence(h))
        conf = None if confs[0] is None else torch.stack(confs, 1)
        return torch.stack(drafts, 1), torch.stack(qs, 1), conf


def proposal_logits(draft: TappedDraft, logits: Tensor) -> Tensor:
    """The logits the engine draws drafts from: the head's, times the draft's ``proposal_scale``
    (`TappedDraft`; read at every call, so a scale set after the engine was made applies)."""
    return logits if draft.proposal_scale == 1.0 else logits * draft.proposal_scale


def make_drafter(draft, policy_cfg=None):
    """Wrap an `Eagle3Draft`, a `BlockDraft` or a standalone `Transformer` draft LM; checks it
    fits the policy."""
    if isinstance(draft, BlockDraft):
        return BlockDrafter(draft, policy_cfg)
    if isinstance(draft, Eagle3Draft):
        return Eagle3Drafter(draft, policy_cfg)
    if isinstance(draft, Transformer):
        return LMDrafter(draft, policy_cfg)
    if hasattr(draft, "new_cache") and hasattr(draft, "features"):
        return draft  # already a drafter
    raise TypeError(f"cannot draft with a {type(draft).__name__}: "
                    "expected Eagle3Draft, BlockDraft or Transformer")
