"""The block draft: ONE forward proposes a whole block of tokens (DFlash, arXiv 2602.06036), with
DSpark's sequential correction and confidence heads, each switchable.

# N rows, G block length (gamma), W context entries, C hidden size, Vd head rows, L draft layers

Entries are EAGLE-3's (`cospec.models.draft`): entry t holds the policy's tapped features of
position t - 1 (zeros at t = 0), fused by ``fc`` (3C -> C). They are the draft's *context*: at
every draft layer l, entry t contributes one key and value, ``k_l(ctx_norm_l(fc(feature_t)))`` and
``v_l(...)`` at RoPE position t: the policy's own view of the sequence injected into each layer's
attention, which is where DFlash puts the target's hidden states.

The *block* at anchor n (the pending token s_n: sampled, not yet seen by the policy) is G queries at
positions n .. n+G-1, their inputs embed(s_n) and then a learned mask embedding G - 1 times. Each
layer is a plain pre-norm decoder layer whose attention reads the context entries 0..n and the
block's own keys at positions <= i: causal inside the block (DFlash attends both ways there). Causal
makes a shorter block the prefix of a longer one, so the confidence scheduler can cut the verify
length after drafting without drafting again, and training needs no mask of its own (the trunk +
branch attention of `cospec.models.branch_attention` is exactly this visibility). Block position
i's output h_i predicts s_{n+1+i}.

Heads, for position i with y_0 = s_n and y_i = x_{i-1}, the token drafted at position i - 1:
- sequential correction (DSpark): h'_i = h_i + W_c rmsnorm(embed(y_i)); the parallel proposal is
  told which token its predecessor became. W_c starts at zero (the correction starts as a no-op).
  Without it h'_i = h_i and all G positions are drawn at once;
- logits_i = lm_head(norm(h'_i)) over the head's rows (a reduced draft vocabulary as EAGLE-3's);
- confidence (DSpark): c_i = sigmoid(w . norm(h'_i) + b), an estimate of the probability that
  draft i is accepted once drafts 0..i-1 were. Its input is detached: it is a probe of the draft,
  trained to 1 - TV(p_i, q_i) (that probability exactly, Leviathan et al. 2211.17192, Sec. 3.5),
  and cannot pull the draft's features towards being easy to judge.
The math, restated: docs/design.md, "Block drafter (DFlash, DSpark)".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cospec.config import ModelConfig
from cospec.models.attention import AttentionCallable, sdpa_attention
from cospec.models.draft import TappedDraft, draft_model_config
from cospec.models.llama import DecoderLayer, RMSNorm, Transformer, apply_rope, forward_context, rope_cos_sin


class BlockDraft(TappedDraft):
    def __init__(self, policy_cfg: ModelConfig, *, tap_layers: tuple[int, ...] = (),
                 num_layers: int = 1, intermediate_size: int = 0, vocab_ids: Tensor | None = None,
                 correction: bool = False, confidence: bool = True,
                 attn_fn: AttentionCallable = sdpa_attention):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"a block draft needs at least one layer, got num_layers={num_layers}")
        self._init_inputs(policy_cfg, tap_layers)
        self.config = draft_model_config(policy_cfg, num_layers=num_layers,
                                         intermediate_size=intermediate_size)
        self.attn_fn = attn_fn
        C, eps = policy_cfg.hidden_size, policy_cfg.rms_norm_eps
        # Keyed 0..L-1 like the policy's layers, so `KVCache.for_model` sizes the draft's cache.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(self.config, i) for i in range(num_layers)})
        self.context_norms = nn.ModuleDict({str(i): RMSNorm(C, eps) for i in range(num_layers)})
        self._init_head(vocab_ids)
        self.mask_embedding = nn.Parameter(torch.zeros(C))
        self.correction_norm = RMSNorm(C, eps) if correction else None
        self.correction = nn.Linear(C, C, bias=False) if correction else None
        self.confidence_head = nn.Linear(C, 1) if confidence else None
        Transformer.reset_parameters(self)
        nn.init.normal_(self.mask_embedding, std=0.02)
        if correction:
            nn.init.zeros_(self.correction.weight)

    @classmethod
    def from_policy(cls, policy: Transformer, *, init_from_policy: bool = True,
                    **kwargs) -> "BlockDraft":
        """A block draft sized for `policy`, on its device and dtype (kwargs: the constructor's)."""
        p = next(policy.parameters())
        draft = cls(policy.config, **kwargs)
        if init_from_policy:
            draft.copy_from_policy(policy)
        return draft.to(device=p.device, dtype=p.dtype)

    @property
    def has_correction(self) -> bool:
        return self.correction is not None

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    def context_kv(self, layer_id: int, feat_BWC: Tensor, cos: Tensor, sin: Tensor):
        """Rotated context keys and values [B, Hkv, W, D] of layer `layer_id` from fused features."""
        attn = self.layers[str(layer_id)].self_attn
        x = self.context_norms[str(layer_id)](feat_BWC)
        B, W, _ = x.shape
        k = attn.k_proj(x).view(B, W, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, W, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def block_inputs(self, anchor_B: Tensor, length: int) -> Tensor:
        """[B, G, C]: embed(anchor), then the mask embedding G - 1 times."""
        first = self.embed_tokens(anchor_B)[:, None]
        rest = self.mask_embedding.to(first.dtype).expand(first.shape[0], length - 1, -1)
        return torch.cat([first, rest], dim=1)

    def corrected(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """h' = h + W_c rmsnorm(embed(y)) (the sequential correction), or h without it."""
        if self.correction is None:
            return hidden
        return hidden + self.correction(self.correction_norm(self.embed_tokens(prev_tokens)))

    def logits(self, corrected_hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(corrected_hidden))

    def confidence(self, corrected_hidden: Tensor) -> Tensor | None:
        """Estimated acceptance probability of each position's draft, [...] (None without the head)."""
        if self.confidence_head is None:
            return None
        return torch.sigmoid(self.confidence_head(self.norm(corrected_hidden.detach()))[..., 0])

    # ---------------------------------------------------------------- decoding with a KV cache

    def add_context(self, kv_cache, feat_NWC: Tensor, rows_N: Tensor | None,
                    num_valid_N: Tensor | int) -> None:
        """Write W context entries per row (fused features [N, W, C]) at each row's cache length,
        and advance the rows by ``num_valid_N`` (a ragged catch-up pads past short rows)."""
        N, W, _ = feat_NWC.shape
        used = kv_cache.check_room(W, rows_N)
        lengths = kv_cache.lengths_B if rows_N is None else kv_cache.lengths_B[rows_N]
        cos, sin = rope_cos_sin(lengths[:, None] + torch.arange(W, device=feat_NWC.device), self.config)
        cos, sin = cos.to(feat_NWC.dtype), sin.to(feat_NWC.dtype)
        for lid in self.layers:
            k, v = self.context_kv(int(lid), feat_NWC, cos, sin)
            kv_cache.update(int(lid), k, v, rows_N, used)
        kv_cache.advance(num_valid_N, rows_N)

    def propose(self, kv_cache, anchor_N: Tensor, length: int, rows_N: Tensor | None) -> Tensor:
        """One forward of the block [anchor, mask x (length - 1)] against the rows' context (the
        cache holds entries 0..n, the anchor sitting at position n); returns the block's hidden
        [N, G, C]. The block's keys are written past the context and not kept (the cache's lengths
        are unchanged): the next `add_context` overwrites them."""
        x = self.block_inputs(anchor_N, length)
        lengths = kv_cache.lengths_B if rows_N is None else kv_cache.lengths_B[rows_N]
        positions = lengths[:, None] - 1 + torch.arange(length, device=x.device)
        ctx, cos, sin = forward_context(self.config, x, cu_seqlens=None, positions_BT=positions,
                                        kv_cache=kv_cache, cache_rows=rows_N, attn_fn=self.attn_fn)
        for layer in self.layers.values():
            x = layer(x, cos, sin, ctx)
        return x
