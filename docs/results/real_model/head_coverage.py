"""SmolLM2 (the recipe): how much of the held-out answers a reduced draft head of each size
covers, the head built as draft-train builds it (`draft_vocabulary`: the most frequent ids of
the first NUM_TRAIN training answers, plus the stop ids). A token outside the head has q = 0, so
it only ever comes from the residual draw: the share outside bounds what a wider head can add
(docs/results/real_model.md, "Real tau against expected tau"). Counting only, no forward.

    python docs/results/real_model/head_coverage.py ANSWER_STORE_DIR NUM_TRAIN SIZE[,SIZE...]

ANSWER_STORE_DIR: out_dir/draft_answers/<fingerprint> (its train/ and held_out/ parts).
"""
import sys

from cospec.config import resolve
from cospec.draft.answer_store import AnswerStore
from cospec.draft.offline import draft_vocabulary
from cospec.models.loading import load_tokenizer, with_checkpoint_model

CAP = 380  # tokens: an answer this long ran to the recipe's 384-token cap


def main(store_dir: str, num_train: int, sizes: list[int]) -> None:
    cfg = with_checkpoint_model(resolve("smollm2-math"))
    stop_ids = tuple(load_tokenizer(cfg.model).stop_ids)
    store = AnswerStore(store_dir)
    kept = store.load("train")
    train = [kept[i].tokens for i in range(num_train) if i in kept]
    held = list(store.load("held_out").values())
    print(f"{len(train)} training answers, {len(held)} held out")
    for size in sizes:
        head = set(draft_vocabulary(train, size, cfg.model.vocab_size, keep=stop_ids).tolist())
        for name, answers in (("all", held), ("capped", [a for a in held if len(a.tokens) >= CAP]),
                              ("not capped", [a for a in held if len(a.tokens) < CAP])):
            tokens = [x for a in answers for x in a.tokens]
            print(f"head of {size:>6} ids: held-out tokens outside it, {name:>10}: "
                  f"{sum(x not in head for x in tokens) / len(tokens):.4f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")])
