"""A Llama-family decoder (Llama, Qwen2) in plain single-device PyTorch.

# B batch, T tokens, S key slots, H heads, Hkv kv heads, D head dim, C hidden size, V vocab

One `forward` serves three uses:
1. packed training: ``tokens_BT`` with B == 1 and ``cu_seqlens``; positions restart at every
   sequence and attention never crosses a boundary;
2. incremental decoding with a `KVCache` whose rows have their own lengths;
3. scoring T > 1 new tokens per row against the cache in one call (speculative verification).
It can also return hidden states of ``tap_layers`` (output of those decoder layers, 0-based) from the
same pass.

Module names follow HF's checkpoint names less the ``model.`` prefix (``layers.3.self_attn.q_proj``),
and layers live in a ``ModuleDict`` keyed by their global index, so a pipeline stage can drop layers
(and the embedding or head) and still load the checkpoint's names. Parallelism is applied from
``cospec/parallel`` through the ``attn_fn`` seam; nothing here knows about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cospec.config import ModelConfig
from cospec.models.attention import AttentionCallable, AttentionLayout, cache_mask, sdpa_attention


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 (Zhang & Sennrich 2019; HF Llama's numerics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x.to(dtype)
        # Under autocast each matmul that reads this would cast it to bf16 on its own, and
        # autograd would keep every cast (q, k and v: three copies of one tensor): cast once here
        # (the same values; docs/results/parallel_grpo.md, "Mixed precision", checks gradients)
        if torch.is_autocast_enabled(out.device.type):
            out = out.to(torch.get_autocast_dtype(out.device.type))
        return out


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """[D/2] RoPE angular frequencies theta^(-2i/D) in fp32, rescaled if rope_scaling="llama3".

    Llama 3.1's scaling (the rope_type "llama3" of HF checkpoints) stretches long wavelengths so a
    model pretrained at original_max_len works at longer contexts. Per frequency f, wavelength
    w = 2 pi / f, with w_low = original_max_len / low_freq_factor and w_high = original_max_len /
    high_freq_factor:
    1. w < w_high (high frequencies, local detail): f is kept;
    2. w > w_low (low frequencies): f / factor;
    3. between: smooth = (original_max_len / w - low_freq_factor) / (high - low_freq_factor), and
       f' = (1 - smooth) f / factor + smooth f, which meets steps 1 and 2 at the two edges.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device,
                                                     dtype=torch.float32) / d))
    if cfg.rope_scaling == "none":
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((cfg.rope_original_max_len / wavelen - low) / (high - low)).clamp(0, 1)
    # clamp(0, 1) is steps 1 and 2: smooth >= 1 exactly when w <= w_high, <= 0 when w >= w_low.
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(positions_BT: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, T, D] for rotary embedding (Su et al. 2104.09864), HF's half-split layout."""
    inv_freq = rope_inv_freq(cfg, positions_BT.device)
    freqs = positions_BT.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos(), emb.sin()


def apply_rope(x_BHTD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x_BHTD.shape[-1] // 2
    rotated = torch.cat([-x_BHTD[..., half:], x_BHTD[..., :half]], dim=-1)
    return (x_BHTD * cos + rotated * sin).to(x_BHTD.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, in_features: int | None = None):
        """in_features: width of the input (default hidden_size; the EAGLE-3 draft layer reads 2C)."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d_in = in_features or cfg.hidden_size
        self.q_proj = nn.Linear(d_in, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x_BTC: Tensor, cos: Tensor, sin: Tensor, ctx: "ForwardContext") -> Tensor:
        B, T, _ = x_BTC.shape
        q = self.q_proj(x_BTC).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTC).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTC).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.kv_cache is not None:
            k, v = ctx.kv_cache.update(self.layer_id, k, v, ctx.cache_rows, ctx.cache_used)
        out = ctx.attn_fn(q, k, v, ctx.layout)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2002.05202): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: "ForwardContext") -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardContext:
    """What every layer of one forward shares (built once in `Transformer.forward`)."""

    layout: AttentionLayout
    attn_fn: AttentionCallable
    kv_cache: object | None = None
    cache_rows: Tensor | None = None
    cache_used: int = 0


@dataclass
class ModelOutput:
    """logits: [B, T, V] (None when the stage has no head); hidden: final hidden before the norm
    [B, T, C]; taps: {layer id: [B, T, C]} outputs of the requested decoder layers."""

    logits: Tensor | None
    hidden: Tensor
    taps: dict[int, Tensor] = field(default_factory=dict)


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """[T] position of every packed token within its own sequence (restarts at each boundary)."""
    idx = torch.arange(total, device=cu_seqlens.device)
    seq_id = torch.bucketize(idx, cu_seqlens[1:], right=True).clamp(max=len(cu_seqlens) - 2)
    return idx - cu_seqlens[seq_id]


def forward_context(cfg: ModelConfig, x_BTC: Tensor, *, cu_seqlens: Tensor | None,
                    positions_BT: Tensor | None, kv_cache, cache_rows: Tensor | None,
                    attn_fn: AttentionCallable) -> tuple[ForwardContext, Tensor, Tensor]:
    """Attention layout, RoPE cos/sin and positions for one forward of T new tokens per row.

    Shared by the policy and the draft (same three uses as `Transformer.forward`). Positions when
    None: cache length + offset with a cache; restarting per sequence when packed; else 0..T-1.
    """
    B, T, _ = x_BTC.shape
    device = x_BTC.device
    if kv_cache is not None:
        if cu_seqlens is not None:
            raise ValueError("packed input (cu_seqlens) cannot be combined with a KV cache")
        used = kv_cache.check_room(T, cache_rows)  # the forward's one device sync
        lengths = kv_cache.lengths_B if cache_rows is None else kv_cache.lengths_B[cache_rows]
        if positions_BT is None:
            positions_BT = lengths[:, None] + torch.arange(T, device=device)[None, :]
        # Only the first `used` slots can be visible: attending past them would be wasted work.
        layout = AttentionLayout(mask=cache_mask(lengths, T, used))
    elif cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed input must have batch size 1, got tokens of shape {(B, T)}")
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
        if int(cu_seqlens[-1]) != T or int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {T}, "
                             f"got {cu_seqlens.tolist()}")
        if positions_BT is None:
            positions_BT = packed_positions(cu_seqlens, T)[None]
        layout = AttentionLayout(cu_seqlens=cu_seqlens)
        used = 0
    else:
        if positions_BT is None:
            positions_BT = torch.arange(T, device=device)[None].expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
        layout = AttentionLayout(mask=causal)
        used = 0
    if kv_cache is None:
        # Packed rows may be longer than max_seq_len; each sequence in them may not.
        longest = T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > cfg.max_seq_len:
            raise ValueError(f"sequence of {longest} tokens exceeds model.max_seq_len={cfg.max_seq_len}")
    ctx = ForwardContext(layout=layout, attn_fn=attn_fn, kv_cache=kv_cache, cache_rows=cache_rows,
                         cache_used=used)
    cos, sin = rope_cos_sin(positions_BT, cfg)
    return ctx, cos.to(x_BTC.dtype), sin.to(x_BTC.dtype)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_ids: list[int] | None = None,
                 has_embedding: bool = True, has_head: bool = True,
                 attn_fn: AttentionCallable = sdpa_attention):
        super().__init__()
        self.config = cfg
        self.attn_fn = attn_fn
        ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if has_head else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if has_head else None
        # Ids past this are never sampled (an embedding padded beyond the tokenizer's vocabulary,
        # as Qwen2's 151936 rows for 151665 tokens): their logits are pushed to MASKED_LOGIT.
        self.sampled_vocab_size: int | None = None
        self.reset_parameters()
        if cfg.tie_embeddings and has_embedding and has_head:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def forward(self, tokens_BT: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                cu_seqlens: Tensor | None = None, positions_BT: Tensor | None = None,
                kv_cache=None, cache_rows: Tensor | None = None, num_valid_B: Tensor | None = None,
                tap_layers: tuple[int, ...] | list[int] = (), detach_taps: bool = True,
                attn_fn: AttentionCallable | None = None,
                logits_positions_B: Tensor | None = None) -> ModelOutput:
        """Run the layers this module holds.

        tokens_BT: token ids (or ``inputs_embeds`` [B, T, C] on a stage without the embedding).
        cu_seqlens: int [N+1] for a packed row (B must be 1): see `AttentionLayout`.
        positions_BT: RoPE positions; derived when None (packed: restart per sequence; cache:
            cache length + offset; else 0..T-1).
        kv_cache: a `KVCache`; the call writes T tokens per addressed row at its current length and
            advances it by ``num_valid_B`` (default T). cache_rows: int [B] rows of the cache this
            call addresses (default all, in order).
        tap_layers: decoder layer ids whose outputs to return in ``taps`` (detached by default).
        logits_positions_B: int [B], the one position of each row whose logits are wanted (a
            prefill samples only after the prompt's last token): logits are then [B, 1, V], and
            the head's cost (N x T x V, the largest matmul of a 49K-vocabulary prefill) drops to
            N x V. Or int [B, K], K positions of each row (the policy step wants its response
            positions only, `cospec.rl.policy_step`): logits [B, K, V]. None: every position.
        """
        x = self.embed_tokens(tokens_BT) if inputs_embeds is None else inputs_embeds
        ctx, cos, sin = forward_context(self.config, x, cu_seqlens=cu_seqlens,
                                        positions_BT=positions_BT, kv_cache=kv_cache,
                                        cache_rows=cache_rows, attn_fn=attn_fn or self.attn_fn)
        wanted = set(tap_layers)
        unknown = wanted - {int(i) for i in self.layers.keys()}
        if unknown:
            raise ValueError(f"tap_layers {sorted(unknown)} are not layers of this model/stage")
        taps: dict[int, Tensor] = {}
        for lid, layer in self.layers.items():
            x = layer(x, cos, sin, ctx)
            if int(lid) in wanted:
                taps[int(lid)] = x.detach() if detach_taps else x
        if kv_cache is not None:
            kv_cache.advance(x.shape[1] if num_valid_B is None else num_valid_B, cache_rows)
        head_in = x
        if logits_positions_B is not None and logits_positions_B.dim() == 2 and x.shape[0] == 1:
            # a packed row's positions (training): index_select's backward is a scatter-add,
            # advanced indexing's an accumulating index_put
            head_in = x[0].index_select(0, logits_positions_B[0])[None]
        elif logits_positions_B is not None:
            at_BK = logits_positions_B if logits_positions_B.dim() == 2 else logits_positions_B[:, None]
            head_in = x[torch.arange(x.shape[0], device=x.device)[:, None], at_BK]
        logits = self.lm_head(self.norm(head_in)) if self.lm_head is not None else None
        if logits is not None and self.sampled_vocab_size is not None \
                and self.sampled_vocab_size < logits.shape[-1]:
            logits = mask_vocab_tail(logits, self.sampled_vocab_size)
        return ModelOutput(logits=logits, hidden=x, taps=taps)


# Finite, so that 0 * logprob stays 0 in entropies and KLs (-inf would give NaN), and far enough
# below any real logit that softmax gives exactly 0 even after dividing by a small temperature.
MASKED_LOGIT = -1e9


def mask_vocab_tail(logits: Tensor, keep: int) -> Tensor:
    """logits with every id >= keep set to MASKED_LOGIT (out of place: autograd-safe)."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(ids >= keep, MASKED_LOGIT)
