"""The policy's answers that offline draft training learns from, kept on disk as they are made.

On a real model, sampling them is most of `cospec draft-train` (SmolLM2-135M in fp32 on 2 CPU
cores: ~1.6 s an answer, half an hour for 1,024), and the draft learns more from more of them
(docs/results/real_model.md). So they outlive the run that made them:

- Answer i of a split depends on (policy, sampling, i) alone: its prompt is the i-th draw of the
  split's own prompt stream, and it samples from its own random stream (`answer_seed`, through the
  engine's per-prompt streams), so the batch, the slot and the run that made it do not change it
  (up to the last-ulp differences another batch shape can make in a forward).
- Each answer reaches the disk soon after it finishes: in parts of `PART_ANSWERS`, each written to
  a temporary file and renamed into place (atomic), and on an interrupt the finished answers not
  yet written are written before the exception goes on.
- The parts live in out_dir/draft_answers/<fingerprint>/<split>/, stamped with the fields that
  make the answers (`answer_fields`: the policy, the task, the sampling, the rollout dtype and
  draft.seed). A later run with the same fields reads them and samples only the missing answers;
  one that asks for more prompts extends the same set.

Splits: "train" (what the draft trains on) and "held_out" (the prompts that measure it as it
trains). The streams are independent draws from the task source, so where its problems are few
(the embedded tasks) a held-out prompt can repeat a training one; its answer is still a sample
of its own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from cospec.atomic_file import write_text_atomically
from cospec.config import RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.metrics.progress import progress_bar

#: prompt stream of each split: random.Random(draft.seed + offset); 777 is the training stream
#: draft-train has always used, so its prompts did not change when the answers became kept
SPLITS = {"train": 777, "held_out": 778}
#: answers per part file: a part is written when this many have finished
PART_ANSWERS = 64


@dataclass(frozen=True)
class Answer:
    """One sampled answer: the prompt's token ids and the response's (with its stop id, if any)."""

    prompt: list[int]
    tokens: list[int]


def answer_seed(seed: int, split: str, index: int) -> int:
    """The random stream of answer ``index`` of ``split``: distinct for every (seed, split, index)."""
    return ((seed * 1_000_003 + SPLITS[split]) * 1_000_033 + index) % 2 ** 63


def split_prompts(cfg: RunConfig, data: TaskData, split: str, count: int) -> list[list[int]]:
    """The first ``count`` prompts of ``split`` (token ids): a prefix of one stream, so asking for
    more keeps the earlier ones."""
    rng = random.Random(cfg.draft.seed + SPLITS[split])
    return [data.prompt_ids(data.source.sample(rng)) for _ in range(count)]


class AnswerStore:
    """The kept answers of one policy and sampling, in ``dir`` (`cospec.artifacts.answer_store`
    names it by their fingerprint and stamps it)."""

    def __init__(self, dir: Path):
        self.dir = Path(dir)

    def load(self, split: str) -> dict[int, Answer]:
        """Every kept answer of ``split`` by index; a part that cannot be read is skipped (its
        answers are sampled again) with a message."""
        answers = {}
        for part in sorted((self.dir / split).glob("part-*.jsonl")):
            try:
                for line in part.read_text().splitlines():
                    row = json.loads(line)
                    answers[int(row["i"])] = Answer(list(row["prompt"]), list(row["tokens"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"warning: skipping unreadable kept answers {part} ({e})")
        return answers

    def write(self, split: str, rows: dict[int, Answer]) -> None:
        """Keep ``rows`` as one more part (temporary file, then an atomic rename)."""
        if not rows:
            return
        folder = self.dir / split
        folder.mkdir(parents=True, exist_ok=True)
        number = 1 + max((int(p.stem.split("-")[1]) for p in folder.glob("part-*.jsonl")), default=-1)
        final = folder / f"part-{number:05d}.jsonl"
        write_text_atomically(final, "".join(
            json.dumps({"i": i, "prompt": a.prompt, "tokens": a.tokens}) + "\n"
            for i, a in sorted(rows.items())))


def policy_answers(cfg: RunConfig, policy, data: TaskData, split: str, count: int, *,
                   store: AnswerStore | None = None, progress: bool = True) -> list[Answer]:
    """The policy's answers to the first ``count`` prompts of ``split`` at the rollout sampling:
    the kept ones from ``store``, the others sampled now (and kept as they finish)."""
    from cospec.models.loading import inference_copy
    from cospec.rollout.engine import GenerationEngine

    prompts = split_prompts(cfg, data, split, count)
    kept = store.load(split) if store is not None else {}
    answers = {i: kept[i] for i in range(count) if i in kept and kept[i].prompt == prompts[i]}
    if len(answers) < len(kept.keys() & set(range(count))):
        print(f"warning: {len(kept.keys() & set(range(count))) - len(answers)} kept {split} answers "
              "were made for other prompts (the prompt rendering changed): sampling them again")
    missing = [i for i in range(count) if i not in answers]
    if store is not None and answers:
        print(f"reusing {len(answers)} kept {split} answers in {store.dir}"
              + (f", sampling {len(missing)} more" if missing else ""))
    if not missing:
        return [answers[i] for i in range(count)]
    s = cfg.sampling
    sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens)
    if cfg.rollout.dtype:  # the answers rollouts would give (and faster to make)
        policy = inference_copy(policy, cfg.rollout.dtype)
    engine = GenerationEngine(policy, batch_size=min(cfg.draft.answer_batch_size or s.batch_size,
                                                     len(missing)),
                              stop_ids=data.tokenizer.stop_ids)
    pending: dict[int, Answer] = {}

    def finished(c) -> None:
        i = missing[c.index]
        answers[i] = pending[i] = Answer(list(c.prompt), list(c.tokens))
        if store is not None and len(pending) >= PART_ANSWERS:
            store.write(split, pending)
            pending.clear()

    with progress_bar(progress, len(missing), f"sampling {split} answers") as tick:
        try:
            engine.generate([prompts[i] for i in missing], sampling,
                            seeds=[answer_seed(cfg.draft.seed, split, i) for i in missing],
                            on_answer=lambda c: (finished(c), tick()))
        finally:  # an interrupt keeps what has finished
            if store is not None:
                store.write(split, pending)
    return [answers[i] for i in range(count)]

