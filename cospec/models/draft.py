"""The EAGLE-3 draft (arXiv 2503.01840): one decoder layer that reads the policy's own features.

# B batch, T tokens, C hidden size, V vocab, K number of tapped layers (3)

Inputs at draft entry t of a sequence s_0 s_1 ...:
- the token s_t (embedded with the draft's embedding, a copy of the policy's), and
- a feature: for the first draft step, ``fc(concat(h_low, h_mid, h_high))`` of the *policy's*
  hidden states at position t - 1 (zeros at t = 0); for draft step j > 1, the draft's own output
  hidden of step j - 1 at the same anchor (EAGLE-3's training-time test).
The decoder layer reads ``concat(norm(embed), norm(feature))`` (2C wide) through q/k/v, keeps the
feature as its residual stream, and its output hidden goes through a norm and an LM head that
predicts s_{t+1} (whose policy distribution is p at position t). A deeper draft
(``num_layers`` > 1; EAGLE-3 has one) puts plain pre-norm decoder layers between that layer and
the head; the hidden a later draft step reads is then the last layer's output.

Entry t pairs the feature of position t - 1 with the token of position t (not the feature of t with
the token t + 1, as the paper writes it): with that shift, entry t sits at position t like the
policy's token t, a packed batch needs no re-layout for the draft (same ``cu_seqlens``), and a
standalone draft LM (entry t = token s_t alone) has the same indexing, so the speculative engine
serves both through one interface (`cospec.rollout.drafter`).

Tap layers default to 1, L/2 - 1, L - 4 (0-based; NeMo RL's choice for EAGLE-3), made increasing
and clamped to the policy's layers: L = 6 -> (1, 2, 3); L = 32 -> (1, 15, 28); L = 2 -> (1, 1, 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from cospec.config import ModelConfig
from cospec.models.attention import AttentionCallable, sdpa_attention
from cospec.models.llama import (MASKED_LOGIT, MLP, Attention, DecoderLayer, RMSNorm, Transformer,
                                 apply_rope, forward_context)


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """(low, mid, high) = (1, L/2-1, L-4), made strictly increasing where L allows, within [0, L-1]."""
    taps = []
    for want in (1, num_layers // 2 - 1, num_layers - 4):
        t = max(want, taps[-1] + 1) if taps else want
        taps.append(min(max(t, 0), num_layers - 1))
    return tuple(taps)


def draft_model_config(policy_cfg: ModelConfig, *, num_layers: int = 1,
                       intermediate_size: int = 0) -> ModelConfig:
    """The draft's shape: the policy's width, heads, vocab and RoPE; its own depth and MLP size."""
    return replace(policy_cfg, num_layers=num_layers,
                   intermediate_size=intermediate_size or policy_cfg.intermediate_size,
                   tie_embeddings=False)


class DraftDecoderLayer(nn.Module):
    """EAGLE-3's first layer: attention over concat(norm(embed), norm(feature))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of the embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # of the feature
        self.self_attn = Attention(cfg, layer_id=0, in_features=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, emb_BTC: Tensor, feat_BTC: Tensor, cos: Tensor, sin: Tensor):
        """Rotated q [B, H, T, D] and k, v [B, Hkv, T, D] of the 2C-wide input."""
        a = self.self_attn
        B, T, _ = emb_BTC.shape
        x = torch.cat([self.input_layernorm(emb_BTC), self.hidden_norm(feat_BTC)], dim=-1)
        q = a.q_proj(x).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, feat_BTC: Tensor, attn_BHTD: Tensor) -> Tensor:
        """Output hidden from the attention output: residual on the feature, then the MLP."""
        B, _, T, _ = attn_BHTD.shape
        h = feat_BTC + self.self_attn.o_proj(attn_BHTD.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftOutput:
    """logits [B, T, Vd] (next-token prediction of each entry over the head's rows: Vd = V
    without a reduced draft vocabulary, see `Eagle3Draft.full_vocab_logits`); hidden [B, T, C]
    (the feature that the next draft step at the same anchor reads)."""

    logits: Tensor
    hidden: Tensor


def vocab_ids_buffer(vocab_ids, vocab_size: int) -> Tensor | None:
    """A reduced draft vocabulary as a long tensor, checked: strictly increasing policy ids in
    [0, vocab_size); None stays None (the head covers the whole vocabulary)."""
    if vocab_ids is None:
        return None
    # .to, not as_tensor: under a meta-device context as_tensor would make a meta tensor
    vocab_ids = (vocab_ids if isinstance(vocab_ids, Tensor)
                 else torch.tensor(list(vocab_ids))).to(dtype=torch.long)
    if vocab_ids.dim() != 1 or len(vocab_ids) == 0 or not bool((vocab_ids[1:] > vocab_ids[:-1]).all()) \
            or int(vocab_ids[0]) < 0 or int(vocab_ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocab_ids must be strictly increasing policy ids in [0, {vocab_size})")
    return vocab_ids


class TappedDraft(nn.Module):
    """What every draft that reads the policy's tapped features shares (EAGLE-3's and the block
    draft, `cospec.models.block_draft`): the taps, their fusing projection ``fc`` (3C -> C), an
    embedding copied from the policy, and an LM head over the whole or a reduced vocabulary.

    ``proposal_scale``: the factor on the head's logits when the draft *proposes* (the engine
    draws from q = softmax(proposal_scale * logits / T)); training and its losses read the logits
    as they are. Any q keeps sampling lossless, so the factor is free to choose: `cospec draft-train`
    fits it on held-out answers to the most expected tau (`cospec.draft.expected_accept_length.
    fit_proposal_scale`; docs/design.md, "The proposal scale"). 1.0 until fitted."""

    proposal_scale: float = 1.0

    def _init_inputs(self, policy_cfg: ModelConfig, tap_layers: tuple[int, ...]) -> None:
        """The taps, fc and the embedding (a subclass then makes its layers, then `_init_head`:
        in that order, so the seeded initialisation is EAGLE-3's as it always was)."""
        L = policy_cfg.num_layers
        self.tap_layers = tuple(tap_layers) or default_tap_layers(L)
        if len(self.tap_layers) != 3 or not all(0 <= t < L for t in self.tap_layers):
            raise ValueError(f"draft.tap_layers must be 3 layer ids in [0, {L}) of the policy, "
                             f"got {list(self.tap_layers)}")
        self.policy_config = policy_cfg
        C = policy_cfg.hidden_size
        self.fc = nn.Linear(len(self.tap_layers) * C, C, bias=False)
        self.embed_tokens = nn.Embedding(policy_cfg.vocab_size, C)

    def _init_head(self, vocab_ids: Tensor | None) -> None:
        """The final norm and the LM head over the whole or a reduced vocabulary."""
        policy_cfg = self.policy_config
        C = policy_cfg.hidden_size
        self.norm = RMSNorm(C, policy_cfg.rms_norm_eps)
        vocab_ids = vocab_ids_buffer(vocab_ids, policy_cfg.vocab_size)
        # Saved with the weights (a buffer), so a loaded draft keeps its mapping.
        self.register_buffer("vocab_ids", vocab_ids)
        head_rows = policy_cfg.vocab_size if vocab_ids is None else len(vocab_ids)
        self.lm_head = nn.Linear(C, head_rows, bias=False)

    def copy_from_policy(self, policy: Transformer) -> None:
        """The policy's embedding, and its head's rows of the draft vocabulary."""
        self.embed_tokens.weight.data.copy_(policy.embed_tokens.weight.data)
        head = policy.lm_head.weight.data
        self.lm_head.weight.data.copy_(head if self.vocab_ids is None
                                       else head[self.vocab_ids.to(head.device)])

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def full_vocab_logits(self, logits: Tensor) -> Tensor:
        """[..., V] logits over the policy's vocabulary: the head's rows at their policy ids,
        MASKED_LOGIT elsewhere (q = 0 there, so verification stays exact)."""
        if self.vocab_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.policy_config.vocab_size), MASKED_LOGIT)
        return full.index_copy(-1, self.vocab_ids, logits)

    def check_policy(self, policy_cfg: ModelConfig) -> None:
        """ValueError unless a policy of this config can feed this draft."""
        mine = self.policy_config
        for name in ("vocab_size", "hidden_size"):
            if getattr(policy_cfg, name) != getattr(mine, name):
                raise ValueError(f"draft/policy mismatch: draft has {name}={getattr(mine, name)}, "
                                 f"policy has {name}={getattr(policy_cfg, name)}")
        if max(self.tap_layers) >= policy_cfg.num_layers:
            raise ValueError(f"draft taps layers {list(self.tap_layers)} but the policy has "
                             f"{policy_cfg.num_layers} layers")

    def concat_taps(self, taps: dict[int, Tensor]) -> Tensor:
        """The tapped policy features side by side, in tap_layers order: [B, T, 3C]."""
        missing = [t for t in self.tap_layers if t not in taps]
        if missing:
            raise ValueError(f"policy features of layers {missing} were not tapped")
        return torch.cat([taps[t] for t in self.tap_layers], dim=-1)

    def project(self, taps: dict[int, Tensor]) -> Tensor:
        """fc(concat of the tapped policy features in tap_layers order): [B, T, C]."""
        return self.fc(self.concat_taps(taps))


class Eagle3Draft(TappedDraft):
    def __init__(self, policy_cfg: ModelConfig, *, tap_layers: tuple[int, ...] = (),
                 num_layers: int = 1, intermediate_size: int = 0, vocab_ids: Tensor | None = None,
                 attn_fn: AttentionCallable = sdpa_attention):
        """vocab_ids: a reduced draft vocabulary (EAGLE-3, Sec. 3.3 of its code release: the head
        covers only the most frequent tokens), the policy ids of the head's rows, strictly
        increasing; None = the policy's whole vocabulary. q is zero outside it. num_layers:
        EAGLE-3's layer, then num_layers - 1 plain decoder layers."""
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an eagle3 draft needs at least one layer, got num_layers={num_layers}")
        self._init_inputs(policy_cfg, tap_layers)
        self.config = draft_model_config(policy_cfg, num_layers=num_layers,
                                         intermediate_size=intermediate_size)
        self.attn_fn = attn_fn
        # Keyed like the policy's layers so `KVCache.for_model` sizes the draft's own cache.
        self.layers = nn.ModuleDict({"0": DraftDecoderLayer(self.config)})
        for i in range(1, num_layers):
            self.layers[str(i)] = DecoderLayer(self.config, i)
        self._init_head(vocab_ids)
        Transformer.reset_parameters(self)

    @classmethod
    def from_policy(cls, policy: Transformer, *, tap_layers: tuple[int, ...] = (),
                    num_layers: int = 1, intermediate_size: int = 0,
                    init_from_policy: bool = True, layer_from_policy: bool = False,
                    vocab_ids: Tensor | None = None) -> "Eagle3Draft":
        """A draft sized for `policy`, on its device and dtype; embedding and head (its rows of the
        draft vocabulary) copied from it; layer_from_policy: its layers too
        (`copy_layer_from_policy`)."""
        p = next(policy.parameters())
        draft = cls(policy.config, tap_layers=tap_layers, num_layers=num_layers,
                    intermediate_size=intermediate_size, vocab_ids=vocab_ids)
        if init_from_policy:
            draft.copy_from_policy(policy)
        if layer_from_policy:
            draft.copy_layer_from_policy(policy)
        return draft.to(device=p.device, dtype=p.dtype)

    def copy_layer_from_policy(self, policy: Transformer) -> None:
        """Start the draft's layers as the policy layers that follow the high tap, applied to it.

        fc passes the high tap through unchanged; q, k and v read the feature half of their input
        with that layer's weights (the feature norm takes its input norm's weight); o_proj, the
        post-attention norm and the MLP are copies; the embedding half keeps its random init
        scaled by 0.1. At the start the draft at entry t therefore computes the policy's next
        layer on the feature of t - 1 (a state that predicts s_t, one position early), with its
        own token barely heard; training shifts it (docs/design.md, "Starting the draft's layer
        from the policy's"). A deeper draft's further layers are copies of the policy's next
        ones, so it starts as the policy's layers hi + 1 .. hi + num_layers. Why it helps: the
        layer starts from weights that already read and write the policy's residual stream, not
        from noise (measured on SmolLM2-135M after the same 240 steps: held-out acceptance
        +0.06-0.07 at every TTT step, tau 1.71 -> 1.88 in rollouts; docs/results/real_model.md)."""
        C, hi, n = self.config.hidden_size, max(self.tap_layers), len(self.layers)
        src_id = hi + 1
        if src_id + n - 1 >= policy.config.num_layers:
            raise ValueError(f"draft.layer_from_policy copies the {n} layer(s) after the high tap "
                             f"{hi}, but the policy's last layer is {policy.config.num_layers - 1}")
        missing = [i for i in range(src_id, src_id + n) if str(i) not in policy.layers]
        if missing:
            raise ValueError(f"draft.layer_from_policy copies the policy's layers {missing}, which "
                             "this model (a pipeline stage?) does not hold")
        src, dst = policy.layers[str(src_id)], self.layers["0"]
        if src.mlp.gate_proj.weight.shape != dst.mlp.gate_proj.weight.shape:
            raise ValueError("draft.layer_from_policy needs the draft's MLP the policy's size "
                             f"(draft.intermediate_size=0), got {dst.mlp.gate_proj.weight.shape[0]} "
                             f"against the policy's {src.mlp.gate_proj.weight.shape[0]}")
        with torch.no_grad():
            self.fc.weight.zero_()
            col = list(self.tap_layers).index(hi) * C
            self.fc.weight[:, col:col + C].copy_(torch.eye(C))
            dst.hidden_norm.weight.copy_(src.input_layernorm.weight)
            for name in ("q_proj", "k_proj", "v_proj"):
                mine, theirs = getattr(dst.self_attn, name), getattr(src.self_attn, name)
                mine.weight[:, :C] *= 0.1
                mine.weight[:, C:].copy_(theirs.weight)
                if mine.bias is not None:
                    mine.bias.copy_(theirs.bias)
            dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
            dst.mlp.load_state_dict(src.mlp.state_dict())
            for i in range(1, n):
                self.layers[str(i)].load_state_dict(policy.layers[str(src_id + i)].state_dict())

    def forward(self, tokens_BT: Tensor, feat_BTC: Tensor, *, cu_seqlens: Tensor | None = None,
                positions_BT: Tensor | None = None, kv_cache=None, cache_rows: Tensor | None = None,
                num_valid_B: Tensor | None = None, attn_fn: AttentionCallable | None = None,
                logits_positions_B: Tensor | None = None) -> DraftOutput:
        """One draft step for T entries per row (the same three uses as the policy's forward:
        packed, KV-cache decoding with per-row lengths, several new entries per row).
        attn_fn: this call's attention (default the module's). logits_positions_B: int [B], the
        one entry of each row whose logits are wanted (logits [B, 1, V]; hidden stays [B, T, C]):
        a catch-up draws from its last entry only, and the head is as dear as the layer."""
        if feat_BTC.shape[:2] != tokens_BT.shape or feat_BTC.shape[-1] != self.config.hidden_size:
            raise ValueError(f"draft feature must be [B, T, {self.config.hidden_size}] for tokens "
                             f"{tuple(tokens_BT.shape)}, got {tuple(feat_BTC.shape)}")
        emb = self.embed_tokens(tokens_BT)
        ctx, cos, sin = forward_context(self.config, emb, cu_seqlens=cu_seqlens,
                                        positions_BT=positions_BT, kv_cache=kv_cache,
                                        cache_rows=cache_rows, attn_fn=attn_fn or self.attn_fn)
        first = self.layers["0"]
        q, k, v = first.qkv(emb, feat_BTC, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(0, k, v, cache_rows, ctx.cache_used)
        h = first.finish(feat_BTC, ctx.attn_fn(q, k, v, ctx.layout))
        for i in range(1, len(self.layers)):
            h = self.layers[str(i)](h, cos, sin, ctx)
        if kv_cache is not None:  # after every layer wrote at the rows' old lengths
            kv_cache.advance(tokens_BT.shape[1] if num_valid_B is None else num_valid_B, cache_rows)
        head_in = h if logits_positions_B is None else \
            h[torch.arange(h.shape[0], device=h.device), logits_positions_B][:, None]
        return DraftOutput(logits=self.lm_head(self.norm(head_in)), hidden=h)
