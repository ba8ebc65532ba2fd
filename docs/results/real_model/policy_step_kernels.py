"""The three kernel costs behind stop 49's cheaper policy step, each measured alone on SmolLM2's
shapes (docs/results/real_model.md, "The policy step and co-training, cheaper"):

    python docs/results/real_model/policy_step_kernels.py

- attention: torch's fused CPU attention (SDPA, causal, GQA 9/3 heads of 64) on 8 sequences of
  132 tokens, forward and backward, in bf16 and in fp32;
- padded layout: unpacking a packed [H, T, D] row (8 sequences of 91-181 tokens) into
  [N, H, L, D] and packing back, forward and backward, by advanced indexing (the old way) and
  by `AttentionLayout.to_padded` / `from_padded` (a copy into zeros and index_select);
- AdamW: one step over SmolLM2-135M's parameters (with random gradients), its for-loop and
  its fused kernel, and the gradient clipping before it;
- a new matmul shape: a [T, 576] x [576, 1536] matmul and its backward under bf16 autocast,
  T = 445 every time, or a new T every time (oneDNN builds a kernel per shape).
Medians after warm-ups; 2 threads.
"""
import statistics
import time

import torch
import torch.nn.functional as F

from cospec.config import ModelConfig
from cospec.models.attention import AttentionLayout
from cospec.models.llama import Transformer


def median_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def attention() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(8, 9, 132, 64, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(8, 3, 132, 64, dtype=dtype, requires_grad=True) for _ in range(2))

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        print(f"attention {str(dtype)[6:]:9s} forward + backward {median_ms(step):6.2f} ms a layer")


def padded_layout() -> None:
    lengths = torch.tensor([91, 106, 119, 129, 137, 146, 163, 181])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    layout = AttentionLayout(cu_seqlens=cu)
    scatter_T, N, L = layout.padded_index()
    gather_NL = torch.minimum(cu[:-1, None] + torch.arange(L)[None], (cu[1:] - 1)[:, None])
    x = torch.randn(9, int(cu[-1]), 64, requires_grad=True)

    def indexing():
        padded = x[:, gather_NL].transpose(0, 1)
        padded.transpose(0, 1).reshape(9, N * L, 64)[:, scatter_T].sum().backward()

    def copying():
        layout.from_padded(layout.to_padded(x)).sum().backward()
    print(f"padded layout, advanced indexing {median_ms(indexing):6.2f} ms; "
          f"copy + index_select {median_ms(copying):6.2f} ms")


def adamw() -> None:
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                      num_kv_heads=3, intermediate_size=1536, max_seq_len=512,
                      rope_theta=100000.0, tie_embeddings=True)
    model = Transformer(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    clip = median_ms(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), 5, 1)
    for fused in (False, True):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), fused=fused)
        print(f"AdamW step, fused={fused}: {median_ms(opt.step, 5, 1):6.1f} ms "
              f"(clipping before it: {clip:.1f} ms)")


def new_shapes() -> None:
    weight = torch.randn(1536, 576, requires_grad=True)
    sizes = iter(range(446, 10_000))

    def matmul(T: int):
        x = torch.randn(T, 576, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ weight.t()
        y.float().sum().backward()
    same = median_ms(lambda: matmul(445))
    new = median_ms(lambda: matmul(next(sizes)))
    print(f"bf16 matmul + backward, T = 445 each time {same:5.2f} ms; a new T each time "
          f"{new:5.2f} ms")


if __name__ == "__main__":
    print(f"threads {torch.get_num_threads()}")
    attention()
    padded_layout()
    adamw()
    new_shapes()
