"""`cospec export`: a run's policy and draft in the layouts other tools read.

    cospec export [--out DIR] [config as for the run]

- ``DIR/policy``: the policy as an HF checkpoint (config.json, model.safetensors) that
  transformers' ``from_pretrained`` loads, with the tokenizer files (tokenizer.json,
  tokenizer_config.json with the chat template) and a generation_config.json naming every stop id,
  when the run's tokenizer is a checkpoint's own (the embedded model's character tokenizer has no
  HF form). Its stated context length is the source checkpoint's, not the run's cache length.
- ``DIR/draft_eagle3``: the EAGLE-3 draft in the layout vLLM's and SGLang's EAGLE-3 loaders and
  SpecForge read (`cospec.models.eagle3_export`; what differs in their use of it is written there).
  A block draft or a draft LM is not exported, and the command says so. vLLM and SGLang do load
  DFlash drafts (method ``dflash``), but that model computes differently from cospec's block draft
  in ways no rewriting of weights bridges: attention both ways inside the block (cospec's is
  causal, so a shorter block is a prefix of a longer one), Qwen3's q/k norms, one context norm
  shared by all layers (cospec has one per layer), a mask token of the target's vocabulary (cospec
  learns a mask embedding), the target's full head (cospec's may be reduced), and no sequential
  correction or confidence head. Written in that layout, the engines would draft from another
  function than the one cospec trained.

What is exported: the latest RL checkpoint under out_dir/rl/checkpoints when there is one (the
policy and draft as trained), else the run's starting policy and its offline draft (out_dir/draft).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from cospec.config import RunConfig, apply
from cospec.data.tokenizer import HFTokenizer, Tokenizer
from cospec.models.block_draft import BlockDraft
from cospec.models.draft import Eagle3Draft


def context_length(cfg: RunConfig) -> int:
    """The context the exported policy states: the source checkpoint's, or the run's length."""
    if not cfg.model.path:
        return cfg.model.max_seq_len
    from cospec.data.model_files import resolve_model_path
    from cospec.models.loading import checkpoint_model_config

    return checkpoint_model_config(resolve_model_path(cfg.model.path)).max_seq_len


def export_policy(policy, tokenizer: Tokenizer, path: Path, *, max_position_embeddings: int) -> None:
    """The policy as an HF checkpoint directory, with the tokenizer's files where it has them."""
    from cospec.models.hf_checkpoint import save_hf

    arch = "Qwen2ForCausalLM" if policy.config.qkv_bias else "LlamaForCausalLM"
    run_config = policy.config
    policy.config = dataclasses.replace(run_config, max_seq_len=max_position_embeddings)
    try:
        save_hf(policy, path, arch)
    finally:
        policy.config = run_config
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.hf.save_pretrained(str(path))
        gen = {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids),
               "pad_token_id": tokenizer.pad_id}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def export_run(cfg: RunConfig, out: str | Path, *, device: torch.device | str = "cpu",
               reuse: bool = False) -> dict[str, Path]:
    """Write the run's policy (and draft, when it has an EAGLE-3 one) under `out`; their paths."""
    from cospec.artifacts import (draft_fields, fingerprint, kept_copy, load_policy, made_with,
                                  reuse_decision, starting_policy_fields)
    from cospec.draft.offline import draft_dir
    from cospec.models.draft_checkpoint import load_draft
    from cospec.models.eagle3_export import export_eagle3
    from cospec.models.loading import load_tokenizer
    from cospec.rl.checkpoint import latest_checkpoint, load_checkpoint

    out = Path(out)
    last = latest_checkpoint(Path(cfg.out_dir) / "rl" / "checkpoints")
    context = context_length(cfg)
    if last is not None:  # the run's own policy and draft, at the length the run trained at
        ckpt = load_checkpoint(last, device=device)
        policy, draft, source = ckpt["policy"], ckpt["draft"], str(last)
        tokenizer = load_tokenizer(cfg.model)
        if not cfg.model.path:
            context = ckpt["config"].get("model", {}).get("max_seq_len", context)
    else:
        start = load_policy(cfg, device, reuse=reuse)  # its tokenizer too: loaded once
        policy, tokenizer, source = start.policy, start.tokenizer, cfg.model.path or f"{cfg.out_dir}/sft"
        saved = draft_dir(cfg, "eagle3")
        fields = draft_fields(apply(cfg, {"draft": {"kind": "eagle3"}}), starting_policy_fields(cfg))
        kept = kept_copy(saved, fingerprint(fields))  # set aside by a run of other settings
        if made_with(kept, fields):
            saved = kept
        draft = (load_draft(saved, device=device) if saved.exists() and reuse_decision(
            saved, fields, reuse=reuse, what="draft", otherwise="not exporting it") else None)
    written = {}
    export_policy(policy, tokenizer, out / "policy", max_position_embeddings=context)
    written["policy"] = out / "policy"
    if isinstance(draft, Eagle3Draft):
        export_eagle3(draft, out / "draft_eagle3", max_position_embeddings=context)
        written["draft_eagle3"] = out / "draft_eagle3"
    elif draft is not None or cfg.draft.kind != "eagle3":
        # no engine computes a block draft (or a draft LM) the way cospec does (the module
        # docstring lists how DFlash's layout differs): say so, not nothing
        kind = (cfg.draft.kind if draft is None
                else "block" if isinstance(draft, BlockDraft) else "lm")
        print(f"the {kind} draft is not exported: only an EAGLE-3 draft has a layout other tools "
              f"read (the run's own checkpoints keep it)")
    print(f"exported from {source}: " + ", ".join(f"{k} -> {v}" for k, v in written.items()))
    return written
