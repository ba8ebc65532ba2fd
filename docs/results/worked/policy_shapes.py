"""Run from the repository root: python docs/results/worked/policy_shapes.py (docs/results/rollout.md).

Per policy shape (random init, vocab 50): decode(B,1), verify(B,5) and an EAGLE-3 draft step,
relative to decode, at B = 1 and 16, plus a training fwd+bwd of 1024 packed tokens (SFT's step)."""
import time

import torch

from cospec.config import ModelConfig
from cospec.models.llama import Transformer
from cospec.models.draft import Eagle3Draft
from cospec.rollout.speculative import SpeculativeEngine
from cospec.rollout.calibration import calibrate
torch.manual_seed(0)
shapes = {"6x256 (default)": (6, 256, 704, 8), "12x256": (12, 256, 704, 8), "6x384": (6, 384, 1024, 6),
          "8x320": (8, 320, 896, 5)}
for name, (L, H, I, nh) in shapes.items():
    cfg = ModelConfig(vocab_size=50, hidden_size=H, num_layers=L, num_heads=nh, num_kv_heads=2 if nh % 2 == 0 else 1,
                      intermediate_size=I, max_seq_len=256)
    pol = Transformer(cfg).eval(); d = Eagle3Draft.from_policy(pol).eval()
    eng = SpeculativeEngine(pol, d, batch_size=16, gamma=4, adaptive=True)
    with torch.inference_mode():
        calibrate(eng, context=48, repeats=5)
    c = eng.controller.cost
    row = []
    for B in (1, 16):
        dec = c.verify_cost(B, 1); ver = c.verify_cost(B, 5); dr = c.draft_cost(B, 1)
        row.append(f"B{B}: decode {dec*1e3:.2f} ms, verify5/decode {ver/dec:.2f}, draft/decode {dr/dec:.2f}")
    x = torch.randint(4, 50, (1, 1024)); cu = torch.tensor([0, 256, 512, 768, 1024])
    opt_t = []
    for _ in range(4):
        t = time.perf_counter(); pol(x, cu_seqlens=cu).logits.float().logsumexp(-1).mean().backward(); opt_t.append(time.perf_counter() - t)
    print(f"{name}: {pol.num_params()/1e6:.2f}M; " + "; ".join(row) + f"; train 1024 tok {min(opt_t[1:])*1e3:.0f} ms", flush=True)
