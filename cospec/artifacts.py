"""What a saved artifact was made from, so a run reuses it only when the same config would make it.

Every command reuses what an earlier one left in out_dir (the SFT policy, the drafts). Matching
by shape alone reused stale ones: an SFT policy trained for 400 steps kept being used after
``sft.steps=2000``, a draft trained on the previous policy's samples after the policy changed.
So each artifact directory holds ``made_by.json``: the config fields that produced it (`SFT_FIELDS`,
`draft_fields`) and their fingerprint (a SHA-256 of their canonical JSON). A later run computes
the same for its own config: equal, the artifact is reused; different, it is rebuilt, with a
message naming the fields that differ; ``--reuse`` (``reuse=True``) keeps it anyway, with a warning.

A draft is not thrown away when another is made in its place: on a real model it stands for
hours of training. The one replaced moves to a sibling named by the first 16 hex digits of its
own fingerprint (``draft.made-<16 hex>``; one without a readable stamp to ``draft.made-unstamped``),
and a later run whose fields have that fingerprint moves it back instead of training again, even
under ``--reuse`` (`kept_copy`, `set_aside`, `restore_kept`). They are never removed by cospec:
each move names how many are kept and their size. The SFT policy of the embedded model
(minutes) is rebuilt in place.

What is left out is what cannot change the artifact: the SFT policy does not depend on the
prompt source or the RL fields, a draft does not depend on how it is co-trained later.

The workflow that reuses them lives here too, below the CLI: `pick_device`, `load_policy` (the
pretrained checkpoint at model.path, or the embedded model's SFT policy, `load_or_train_sft`) and
`load_or_train_draft`; every command that needs a policy or a draft goes through them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from cospec.atomic_file import write_json_atomically
from cospec.config import ConfigError, DraftConfig, RunConfig
from cospec.data.tokenizer import CharTokenizer, Tokenizer
from cospec.models.integrity import NonFiniteError, nonfinite_names, read_json_object
from cospec.models.llama import Transformer

MADE_BY = "made_by.json"

#: draft fields that only co-training and the oracle read (not the offline training)
_ONLINE_DRAFT_FIELDS = ("mode", "cotrain_every", "cotrain_iters", "cotrain_lr",
                        "cotrain_max_tokens", "oracle_every")
#: draft fields that change how offline training runs, not the draft it makes (fit_proposal_scale:
#: only its proposal scale, which a reused draft sets to 1 when the field is off)
_RUN_DRAFT_FIELDS = ("answer_batch_size", "num_eval_prompts", "eval_every", "checkpoint_every",
                     "keep_policy_outputs", "token_bucket", "fit_proposal_scale")
#: Draft fields added after drafts were saved: left out of the fingerprint at their default, so
#: those drafts are still reused; set otherwise, they make another draft.
_LATER_DRAFT_FIELDS = ("layer_from_policy", "anchor_weight", "eagle3_layers")


def sft_fields(cfg: RunConfig) -> dict:
    """What the embedded SFT policy is made from: the model, the synthetic suite, the SFT run."""
    c = dataclasses.asdict(cfg)
    sft = {k: v for k, v in c["sft"].items() if k != "eval_prompts_per_family"}
    task = {k: c["task"][k] for k in ("families", "weights", "seed")}
    return {"model": c["model"], "task": task, "sft": sft}


def draft_fields(cfg: RunConfig, policy_fields: dict | None = None) -> dict:
    """What an offline-trained draft is made from: its policy (``policy_fields``: the fields the
    policy was made from; default the config's), the prompts and sampling of its training data,
    and its own offline fields."""
    c = dataclasses.asdict(cfg)
    policy = policy_fields or ({"model": c["model"]} if cfg.model.path else sft_fields(cfg))
    default = dataclasses.asdict(DraftConfig())
    draft = {k: v for k, v in c["draft"].items() if k not in _ONLINE_DRAFT_FIELDS + _RUN_DRAFT_FIELDS
             and not (k in _LATER_DRAFT_FIELDS and v == default[k])}
    return {**_sampled_by(cfg, policy), "draft": draft}


def answer_fields(cfg: RunConfig, policy_fields: dict) -> dict:
    """What the answers offline draft training learns from are made from (`cospec.draft.
    answer_store`): the policy, the prompts (task and draft.seed), the sampling and the rollout
    dtype. Not the number of prompts (a later run may ask for more) nor the batch that samples them."""
    return {**_sampled_by(cfg, policy_fields), "seed": cfg.draft.seed}


def _sampled_by(cfg: RunConfig, policy_fields: dict) -> dict:
    """The fields of the policy's samples that a draft learns from: the policy, the task, the
    sampling and the rollout dtype (shared by `draft_fields` and `answer_fields`)."""
    c = dataclasses.asdict(cfg)
    sampling = {k: c["sampling"][k] for k in ("temperature", "top_k", "top_p", "max_new_tokens")}
    return {"policy": policy_fields, "task": c["task"], "sampling": sampling,
            "rollout_dtype": c["rollout"]["dtype"]}


def answer_store(cfg: RunConfig, policy_fields: dict):
    """out_dir/draft_answers/<fingerprint of `answer_fields`>, stamped, as an `AnswerStore`."""
    from cospec.draft.answer_store import AnswerStore

    fields = answer_fields(cfg, policy_fields)
    path = Path(cfg.out_dir) / "draft_answers" / fingerprint(fields)[:16]
    if read_stamp(path) is None:
        path.mkdir(parents=True, exist_ok=True)
        write_made_by(path, fields)
    return AnswerStore(path)


def fingerprint(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode()).hexdigest()


def write_made_by(path: Path, fields: dict) -> None:
    """Stamp the artifact directory `path` with the fields that made it (after it is complete)."""
    write_json_atomically(Path(path) / MADE_BY,
                          {"fingerprint": fingerprint(fields), "fields": fields}, indent=1, default=list)


def differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two field dicts."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{name}.")
        elif json.dumps(a, default=list) != json.dumps(b, default=list):
            out.append(f"{name} ({a!r} -> {b!r})")
    return out


def read_stamp(path: Path) -> dict | None:
    """The artifact's made_by.json ({"fingerprint", "fields"}), or None when it has none readable."""
    try:
        stamp = json.loads((Path(path) / MADE_BY).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(stamp, dict) and isinstance(stamp.get("fields"), dict)
          and isinstance(stamp.get("fingerprint"), str))
    return stamp if ok else None


def made_with(path: Path, fields: dict) -> bool:
    """Whether the artifact at `path` carries a readable stamp of exactly these fields."""
    return (read_stamp(path) or {}).get("fingerprint") == fingerprint(fields)


def kept_copy(path: Path, fp: str) -> Path:
    """Where an artifact made with fingerprint `fp` is kept once another replaces it at `path`."""
    return path.with_name(f"{path.name}.made-{fp[:16]}")


def set_aside(path: Path, what: str) -> None:
    """Move the artifact at `path` to its kept copy, so that another can take its place (one
    without a readable stamp to ``.made-unstamped``: nothing finds it again, but it is not lost)."""
    stamp = read_stamp(path)
    dest = kept_copy(path, stamp["fingerprint"] if stamp else "unstamped")
    if dest.exists():  # an older copy of the very same settings (or an older unstamped one)
        shutil.rmtree(dest)
    path.rename(dest)
    kept = list(path.parent.glob(f"{path.name}.made-*"))
    mb = sum(f.stat().st_size for d in kept for f in d.rglob("*") if f.is_file()) / 2**20
    print(f"keeping the {what} made with other settings as {dest}"
          + (" (it comes back when they do)" if stamp else " (it has no readable stamp)")
          + f"; {len(kept)} kept beside {path.name}, {mb:.0f} MB: remove those you no longer need")


def restore_kept(path: Path, fields: dict, what: str) -> None:
    """Bring back the kept copy made with `fields` when `path` holds one of other settings."""
    kept = kept_copy(path, fingerprint(fields))
    if not made_with(kept, fields) or made_with(path, fields):
        return
    if path.exists():
        set_aside(path, what)
    kept.rename(path)
    print(f"restored the {what} made with these settings from {kept}")


def made_by_fields(path: Path) -> dict | None:
    """The fields stamped on the artifact at `path`, or None without a readable stamp."""
    stamp = read_stamp(path)
    return stamp["fields"] if stamp else None


def starting_policy_fields(cfg: RunConfig) -> dict:
    """The fields of the policy a run starts from as it is on disk: the stamp of out_dir/sft (which
    ``--reuse`` may have kept although the config asks for other settings), else the config's."""
    if cfg.model.path:
        return {"model": dataclasses.asdict(cfg.model)}
    return made_by_fields(Path(cfg.out_dir) / "sft") or sft_fields(cfg)


def reuse_decision(path: Path, fields: dict, *, reuse: bool = False, what: str,
                   otherwise: str = "rebuilding it") -> bool:
    """Whether the artifact at `path` is to be reused for a run whose config gives `fields`:
    True on a matching fingerprint, or when `reuse` overrides a mismatch; False (rebuild) otherwise.
    Says which, and why, on stdout."""
    path = Path(path)
    saved = read_stamp(path)
    if saved is not None and saved.get("fingerprint") == fingerprint(fields):
        print(f"reusing {what} {path}")
        return True
    if saved is None:
        why = f"has no readable {MADE_BY} (made by an older cospec, or damaged)"
    else:
        diff = differences(saved["fields"], json.loads(json.dumps(fields, default=list)))
        why = "was made with other settings: " + "; ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
    if reuse:
        print(f"warning: reusing {what} {path} as asked (--reuse), although it {why}")
        return True
    print(f"{what} {path} {why}: {otherwise} (--reuse keeps it)")
    return False


# ----------------------------------------------------------------------------- the workflow

def pick_device(name: str) -> torch.device:
    """The ``device`` field as a torch device: auto is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available")
    return torch.device(name)


def load_or_train_sft(cfg: RunConfig, device: torch.device, *, force: bool = False,
                      reuse: bool = False):
    """Reuse out_dir/sft when it was made from the same fields (`sft_fields`; or `reuse`), else
    train and save it. Returns (model, metrics)."""
    from cospec.models.hf_checkpoint import load_hf
    from cospec.sft import save_sft, train_sft

    out = Path(cfg.out_dir)
    ckpt, metrics_path = out / "sft", out / "sft_metrics.json"
    if not force and ckpt.exists() and not metrics_path.exists():
        print(f"SFT checkpoint {ckpt} has no {metrics_path.name} beside it: retraining")
    elif (not force and ckpt.exists()
            and reuse_decision(ckpt, sft_fields(cfg), reuse=reuse, what="SFT checkpoint")):
        model = load_hf(ckpt, device=device)
        if model.config == cfg.model:
            return model.eval(), read_json_object(metrics_path, "the SFT run's metrics")
        print(f"SFT checkpoint {ckpt} has another model config than model.*: retraining")
    model, metrics = train_sft(cfg, device=device)
    bad = nonfinite_names(model.state_dict())
    if bad:
        raise NonFiniteError(f"SFT diverged (final loss {metrics['final_loss']}): non-finite "
                             f"weights in {', '.join(bad[:3])}; nothing saved (lower sft.lr?)")
    save_sft(model, metrics, cfg, out)
    write_made_by(ckpt, sft_fields(cfg))
    print(f"saved SFT checkpoint to {ckpt}")
    return model, metrics


@dataclass
class StartingPolicy:
    """policy: the model RL starts from (eval mode); tokenizer: its own; sft_metrics: the SFT
    run's metrics for the embedded model (None for a pretrained checkpoint)."""

    policy: Transformer
    tokenizer: Tokenizer
    sft_metrics: dict | None


def load_policy(cfg: RunConfig, device: torch.device, *, reuse: bool = False) -> StartingPolicy:
    """The pretrained checkpoint at model.path (with its tokenizer), or the SFT policy of the
    embedded model (trained when out_dir holds none made from the same fields, or `reuse`)."""
    if cfg.model.path:
        from cospec.models.loading import load_pretrained, load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        return StartingPolicy(load_pretrained(cfg.model, tokenizer, device=device), tokenizer, None)
    policy, metrics = load_or_train_sft(cfg, device, reuse=reuse)
    return StartingPolicy(policy, CharTokenizer(), metrics)


def load_or_train_draft(cfg: RunConfig, policy: Transformer, *, force: bool = False,
                        data=None, progress: bool = True, reuse: bool = False, fresh: bool = False):
    """Reuse the saved draft of ``draft.kind`` when it was made from the same fields
    (`draft_fields`: the policy's among them; or `reuse`) and fits the policy, else train and save
    one: from the answers kept in out_dir/draft_answers (`cospec.draft.answer_store`), resuming an
    interrupted training of the same fields from out_dir/<draft dir>.partial unless ``fresh``
    (`cospec.draft.offline_checkpoint`); its metrics go to train_metrics.json and
    training_curve.png beside it. Returns (draft, metrics or None when reused)."""
    from cospec.draft.offline import draft_dir, draft_fits, train_draft_offline
    from cospec.draft.offline_checkpoint import OfflineCheckpoint
    from cospec.metrics.draft_training import plot_draft_training
    from cospec.models.draft_checkpoint import load_draft, save_draft

    path = draft_dir(cfg)
    device = next(policy.parameters()).device
    policy_fields = starting_policy_fields(cfg)
    fields = draft_fields(cfg, policy_fields)
    if not force:  # draft-train trains anew in any case: what is in place moves aside at the save
        restore_kept(path, fields, "draft")
    if (not force and path.exists()
            and reuse_decision(path, fields, reuse=reuse, what="draft")):
        draft = load_draft(path, device=device)
        if draft_fits(draft, cfg, policy):
            if not cfg.draft.fit_proposal_scale and hasattr(draft, "proposal_scale"):
                draft.proposal_scale = 1.0  # the draft as trained, whatever its training fitted
            return draft.eval(), None
        print(f"draft {path} does not fit this policy and draft config: retraining")
    checkpoint = OfflineCheckpoint(path.with_name(path.name + ".partial"), fingerprint(fields))
    if fresh:
        checkpoint.remove(other_settings=True)
    answers = answer_store(cfg, policy_fields)
    draft, metrics = train_draft_offline(cfg, policy, data=data, progress=progress, answers=answers,
                                         checkpoint=checkpoint)
    bad = nonfinite_names(draft.state_dict())
    if bad:  # saved, every later command would refuse it as a bad file
        raise NonFiniteError(f"offline draft training diverged (final loss {metrics['final_loss']}): "
                             f"non-finite weights in {', '.join(bad[:3])}; nothing saved (lower "
                             f"draft.lr?)")
    if path.exists() and not made_with(path, fields):
        set_aside(path, "draft")
    save_draft(draft, path)
    write_made_by(path, fields)  # at once: an interrupt before it would leave the draft unstamped
    write_json_atomically(path / "train_metrics.json", metrics, indent=1)
    plot_draft_training(metrics, path / "training_curve.png")
    checkpoint.remove()
    print(f"saved draft to {path}")
    return draft, metrics
