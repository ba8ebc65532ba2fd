"""Run from the repository root after `cospec demo out_dir=/tmp/demo_fresh`: the adaptive
controller's gamma per step at batch 64 (128 prompts), by number of active rows (rollout.md)."""
import random, time, torch, collections
from cospec.config import resolve
from cospec.models.hf_checkpoint import load_hf
from cospec.models.draft_checkpoint import load_draft
from cospec.data.prompts import TaskData
from cospec.data.tokenizer import CharTokenizer
from cospec.rollout.speculative import SpeculativeEngine
from cospec.rollout.engine import GenerationEngine
import cospec.rollout.adaptive as ad
cfg = resolve("default", None, ["out_dir=/tmp/demo_fresh"])
policy = load_hf("/tmp/demo_fresh/sft").eval(); draft = load_draft("/tmp/demo_fresh/draft").eval()
data = TaskData.from_config(cfg.task, CharTokenizer()); rng = random.Random(1)
prompts = [data.prompt_ids(data.source.sample(rng)) for _ in range(128)]
log = []
orig = ad.AdaptiveGamma.choose
def choose(self, n):
    g = orig(self, n); log.append((n, g, {k: self.throughput(n, k) for k in range(self.gamma_max + 1)})); return g
ad.AdaptiveGamma.choose = choose
plain = GenerationEngine(policy, batch_size=64, stop_ids=data.tokenizer.stop_ids)
spec = SpeculativeEngine(policy, draft, batch_size=64, gamma=4, adaptive=True, stop_ids=data.tokenizer.stop_ids)
def run(e):
    t = time.perf_counter()
    with torch.inference_mode(): r = e.generate(prompts, cfg.sampling, generator=torch.Generator().manual_seed(0))
    return r.num_tokens / (time.perf_counter() - t)
run(plain); run(spec); log.clear()
tp = [run(plain) for _ in range(1)]; log.clear(); ts = run(spec)
print("plain", tp, "adaptive", ts, ts / tp[0])
by = collections.defaultdict(collections.Counter)
for n, g, _ in log: by[(n // 16) * 16][g] += 1
for k in sorted(by): print(k, dict(by[k]))
for n, g, tps in log[:3] + [l for l in log if l[0] == 64][:3]:
    print(n, g, {k: round(v, 0) if v else v for k, v in tps.items()})
c = spec.controller.cost
print("verify64", {t: c.verify_cost(64, t) for t in range(1, 6)}, "draft64", c.draft_cost(64, 1))
