"""The policy a run starts from, and the device it runs on.

Two ways in: the embedded model, trained by `cospec sft` on the synthetic tasks and kept in
out_dir/sft (`load_or_train_sft`), or a pretrained checkpoint named by ``model.path``, used as it is
(`cospec.models.loading`). `load_policy` picks by the config and returns the policy with its own
tokenizer; every command that needs a policy goes through it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from cospec.config import ConfigError, RunConfig
from cospec.data.tokenizer import CharTokenizer, Tokenizer
from cospec.models.llama import Transformer


def pick_device(name: str) -> torch.device:
    """The ``device`` field as a torch device: auto is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available")
    return torch.device(name)


def load_or_train_sft(cfg: RunConfig, device: torch.device, *, force: bool = False):
    """Reuse out_dir/sft when its model config (and sft.label_noise) match, else train and save it.
    Returns (model, metrics)."""
    from cospec.models.hf_checkpoint import load_hf
    from cospec.sft import save_sft, train_sft

    out = Path(cfg.out_dir)
    ckpt, metrics_path = out / "sft", out / "sft_metrics.json"
    if not force and ckpt.exists() and metrics_path.exists():
        model = load_hf(ckpt, device=device)
        saved = out / "config.json"
        noise = (json.loads(saved.read_text()).get("sft", {}).get("label_noise", 0.0)
                 if saved.exists() else 0.0)
        if model.config == cfg.model and noise == cfg.sft.label_noise:
            print(f"reusing SFT checkpoint {ckpt}")
            return model.eval(), json.loads(metrics_path.read_text())
        print(f"SFT checkpoint {ckpt} has a different model config or sft.label_noise: retraining")
    model, metrics = train_sft(cfg, device=device)
    save_sft(model, metrics, cfg, out)
    print(f"saved SFT checkpoint to {ckpt}")
    # A saved draft was trained on the previous SFT policy's samples and features: its config
    # still fits, so `load_or_train_draft` would reuse it. Drop it.
    from cospec.draft.offline import draft_dir

    for kind in ("eagle3", "lm"):
        stale = draft_dir(cfg, kind)
        if stale.exists():
            shutil.rmtree(stale)
            print(f"removed {stale}: it was trained on the previous SFT policy")
    return model, metrics


@dataclass
class StartingPolicy:
    """policy: the model RL starts from (eval mode); tokenizer: its own; sft_metrics: the SFT
    run's metrics for the embedded model (None for a pretrained checkpoint)."""

    policy: Transformer
    tokenizer: Tokenizer
    sft_metrics: dict | None


def load_policy(cfg: RunConfig, device: torch.device) -> StartingPolicy:
    """The pretrained checkpoint at model.path (with its tokenizer), or the SFT policy of the
    embedded model (trained when out_dir holds none that fits)."""
    if cfg.model.path:
        from cospec.models.loading import load_pretrained, load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        return StartingPolicy(load_pretrained(cfg.model, tokenizer, device=device), tokenizer, None)
    policy, metrics = load_or_train_sft(cfg, device)
    return StartingPolicy(policy, CharTokenizer(), metrics)
