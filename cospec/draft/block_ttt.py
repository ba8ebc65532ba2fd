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
    dtype = draft.fc.weight.dtype
    context = draft.fc(steps.feat_raw_TF)[None]  # [1, T, C]
    cos0, sin0 = rope_cos_sin(steps.positions_T[None], cfg)
    ropes = [tuple(x.to(dtype) for x in rope_cos_sin((steps.positions_T + i)[None], cfg))
             for i in range(G)]
    # [G, T, C]: position 0 reads the anchor token, the others the mask embedding
    x = draft.block_inputs(steps.tokens_JT[0], G).transpose(0, 1)
    for lid, layer in draft.layers.items():
        attn = layer.self_attn
        trunk_k, trunk_v = draft.context_kv(int(lid), context, cos0.to(dtype), sin0.to(dtype))
        h = layer.input_layernorm(x)
        qs, ks, vs = [], [], []
        for i in range(G):
            q = attn.q_proj(h[i]).view(-1, attn.num_heads, attn.head_dim).transpose(0, 1)[None]
            k = attn.k_proj(h[i]).view(-1, attn.num_kv_heads, attn.head_dim).transpose(0, 1)[None]
            cos, sin = ropes[i]
            qs.append(apply_rope(q, cos, sin)[0])
            ks.append(apply_rope(k, cos, sin)[0])
            vs.append(attn.v_proj(h[i]).view(-1, attn.num_kv_heads, attn.head_dim).transpose(0, 1))
        outs = []
        for i in range(G):
            out, _ = attention(qs[i], trunk_k[0], trunk_v[0], cu_seqlens,
                               torch.stack(ks[:i + 1]), torch.stack(vs[:i + 1]))
            outs.append(attn.o_proj(out.to(dtype).transpose(0, 1).reshape(out.shape[1], -1)))
        x = x + torch.stack(outs)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits, confidence = [], []
    for i in range(G):
        hi = draft.corrected(x[i], steps.tokens_JT[i])
        logits.append(draft.logits(hi))
        confidence.append(draft.confidence(hi))
    return logits, confidence

