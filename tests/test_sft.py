"""SFT: the loss counts answers only, the schedule is right, training learns, saves are atomic."""

import json
import math

import pytest
import torch

from cospec.config import resolve
from cospec.data.tasks import Example, TaskSuite
from cospec.data.packing import pack_examples
from cospec.data.tokenizer import CharTokenizer
from cospec.lr_schedule import lr_at
from cospec.sft import save_sft, sft_loss, train_sft


def test_loss_counts_only_answer_tokens():
    torch.manual_seed(0)
    cfg = resolve("tiny")
    from cospec.models.llama import Transformer

    model = Transformer(cfg.model)
    tok, suite = CharTokenizer(), TaskSuite(cfg.task)
    ex = Example("add", "add:1+2=", "3")
    ids, mask = suite.encode_sft(ex, tok)
    batch = pack_examples([(ids, mask)])
    logits = model(batch.tokens).logits[0]
    # the two answer targets are "3" and EOS, predicted from the last two input positions
    expected = torch.nn.functional.cross_entropy(logits[-2:], batch.targets[0, -2:])
    torch.testing.assert_close(sft_loss(model, batch), expected)


def test_schedule_warms_up_then_decays_to_the_floor():
    kw = dict(lr=1.0, warmup=10, total=110, min_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, **kw) == pytest.approx(0.1)


def test_a_short_sft_run_lowers_the_loss_and_reports_accuracy_per_family():
    cfg = resolve("tiny", overrides=["sft.steps=100", "sft.lr=5e-3"])
    _, metrics = train_sft(cfg, device=torch.device("cpu"), progress=False)
    first, last = metrics["loss_history"][:5], metrics["loss_history"][-5:]
    assert sum(last) / 5 < 0.8 * sum(first) / 5
    assert set(metrics["accuracy"]) == {"copy", "add", "sort", "perm", "mean"}


def test_sft_checkpoint_reloads_to_the_same_model(tmp_path):
    from cospec.models.hf_checkpoint import load_hf

    cfg = resolve("tiny", overrides=["sft.steps=2", "sft.warmup_steps=1"])
    model, metrics = train_sft(cfg, device=torch.device("cpu"), progress=False)
    ckpt = save_sft(model, metrics, cfg, tmp_path)
    again = load_hf(ckpt)
    x = torch.randint(4, cfg.model.vocab_size, (1, 12))
    assert torch.equal(again(x).logits, model(x).logits)
    assert json.loads((tmp_path / "sft_metrics.json").read_text())["steps"] == 2
    assert not list(tmp_path.glob("*.tmp*"))


def test_label_noise_corrupts_answer_tokens_at_its_rate_and_nothing_else():
    import random

    from cospec.config import TaskConfig
    from cospec.data.tokenizer import EOS, SPECIALS
    from cospec.sft import add_label_noise

    suite, tok, rng = TaskSuite(TaskConfig()), CharTokenizer(), random.Random(0)
    changed = answer = 0
    for _ in range(2000):
        ids, mask = suite.encode_sft(suite.sample(rng), tok)
        noisy = add_label_noise(ids, mask, 0.2, rng, tok)
        for a, b, m in zip(ids, noisy, mask):
            if not m or a == EOS:  # prompts and EOS stay as they are
                assert a == b
                continue
            answer += 1
            changed += a != b
            assert len(SPECIALS) <= b < tok.vocab_size
    # A replacement may redraw the same token (1 in 46): expected rate 0.2 * 45/46.
    rate, expected = changed / answer, 0.2 * (tok.vocab_size - len(SPECIALS) - 1) / (tok.vocab_size - len(SPECIALS))
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / answer), (rate, expected)
    assert add_label_noise(ids, mask, 0.0, rng, tok) is ids
