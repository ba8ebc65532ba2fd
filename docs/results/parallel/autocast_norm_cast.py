"""Does casting RMSNorm's output to bf16 once under autocast (instead of once per matmul that
reads it) change the policy's gradients? Compares both against the fp32 gradient on one packed
batch of a small random Llama; docs/results/parallel_grpo.md, "Mixed precision".

    python docs/results/parallel/autocast_norm_cast.py
"""

import torch

from cospec.config import ModelConfig
from cospec.models.llama import RMSNorm, Transformer

CAST_ONCE = RMSNorm.forward


def cast_per_matmul(self, x):  # RMSNorm.forward before the change: the output stays fp32
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x.to(dtype)


def gradients(model, tokens, cu, autocast: bool, forward) -> dict[str, torch.Tensor]:
    RMSNorm.forward = forward
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens, cu_seqlens=cu).logits.float()
    torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=4, max_seq_len=512, hidden_size=256, num_heads=8, num_kv_heads=2,
                      intermediate_size=704, vocab_size=2000)
    model = Transformer(cfg)
    tokens, cu = torch.randint(0, cfg.vocab_size, (1, 384)), torch.tensor([0, 200, 384])
    ref = gradients(model, tokens, cu, False, cast_per_matmul)
    flat = torch.cat([g.flatten() for g in ref.values()])
    for name, forward in (("cast per matmul (before)", cast_per_matmul),
                          ("cast once (RMSNorm now)", CAST_ONCE)):
        got = gradients(model, tokens, cu, True, forward)
        err = (torch.cat([g.flatten() for g in got.values()]) - flat).norm() / flat.norm()
        worst = min(torch.nn.functional.cosine_similarity(got[n].flatten(), ref[n].flatten(),
                                                          dim=0).item() for n in ref)
        print(f"{name}: gradient error vs fp32 {err:.3e} (relative), worst tensor cosine {worst:.5f}")
    RMSNorm.forward = CAST_ONCE


if __name__ == "__main__":
    main()
