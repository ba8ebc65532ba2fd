"""Training the block draft (`cospec.models.block_draft`): a block anchored at every position.

# T packed tokens (anchors), G block length, C hidden size, Vd head rows

DFlash (arXiv 2602.06036) trains blocks anchored at random positions of each sequence; here every
position of the packed row anchors one (the cost is G block positions per token, as EAGLE-3's G
TTT steps), laid out by anchor exactly as the EAGLE-3 unroll (`cospec.draft.ttt.TTTSteps`, whose
fields this reads: ``feat_raw_TF`` the entry features, ``tokens_JT[i]`` the token at t + i,
``targets_JTV[i]`` the policy's logits at t + i, ``mask_JT[i]`` whether position i at anchor t is
trained). Block position i at anchor t sits at position t + i, predicts the token at t + i + 1 and
is trained against the policy's distribution there. Its attention, per layer, sees:
- the trunk: the context keys of entries <= t of its sequence (entry t holds the features of
  position t - 1, so the keys of positions < t: what the draft's cache holds when it drafts at t);
- the branch: the block's own keys at anchor t, positions 0..i.
which is `trunk_branch_attention` with the context keys as trunk and the block positions' keys as
branch steps, so the context-parallel ring (`cospec.parallel.draft_cp`) serves it unchanged.

The sequential correction reads y_i = the token at t + i (teacher forcing: on the policy's own
samples, the prefix verification accepts is distributed as these tokens are).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cospec.models.block_draft import BlockDraft
from cospec.models.branch_attention import trunk_branch_attention
from cospec.models.llama import apply_rope, rope_cos_sin


def block_unroll(draft: BlockDraft, steps, cu_seqlens: Tensor,
                 attention=trunk_branch_attention) -> tuple[list[Tensor], list[Tensor | None]]:
    """(logits [T, Vd] per block position, confidence [T] per block position or None).
    steps: a `cospec.draft.ttt.TTTSteps` (not imported: that module imports this one)."""
    cfg, G = draft.config, steps.tokens_JT.shape[0]
    T, dtype = steps.tokens_JT.shape[1], draft.fc.weight.dtype
    context = draft.fc(steps.feat_raw_TF)[None]  # [1, T, C]
    cos0, sin0 = (x.to(dtype) for x in rope_cos_sin(steps.positions_T[None], cfg))
    # RoPE of block position i at anchor t: position t + i; [G, 1, T, D], one row per i
    offsets = torch.arange(G, device=steps.positions_T.device)
    cos, sin = (x.to(dtype) for x in rope_cos_sin(steps.positions_T[None] + offsets[:, None], cfg))
    # [G, T, C]: position 0 reads the anchor token, the others the mask embedding. Contiguous:
    # on the transposed view every projection would copy its input (q, k, v three copies)
    x = draft.block_inputs(steps.tokens_JT[0], G).transpose(0, 1).contiguous()
    for lid, layer in draft.layers.items():
        attn = layer.self_attn
        trunk_k, trunk_v = draft.context_kv(int(lid), context, cos0, sin0)
        h = layer.input_layernorm(x)  # all G positions through each projection at once
        q = apply_rope(attn.q_proj(h).view(G, T, attn.num_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_proj(h).view(G, T, attn.num_kv_heads, -1).transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(G, T, attn.num_kv_heads, -1).transpose(1, 2)
        outs = []
        for i in range(G):  # position i: the context (trunk) and block keys 0..i (branch)
            out, _ = attention(q[i], trunk_k[0], trunk_v[0], cu_seqlens, k[:i + 1], v[:i + 1])
            outs.append(out.to(dtype).transpose(0, 1).reshape(T, -1))
        x = x + attn.o_proj(torch.stack(outs))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits, confidence = [], []
    for i in range(G):
        hi = draft.corrected(x[i], steps.tokens_JT[i])
        logits.append(draft.logits(hi))
        confidence.append(draft.confidence(hi))
    return logits, confidence

