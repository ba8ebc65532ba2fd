"""What a GRPO checkpoint holds and how every rank writes and restores its part of it.

A checkpoint (`cospec.rl.checkpoint.save_checkpoint`, atomic) holds the full policy and draft, the
config, and the trainer state: the step, the RNG states and the optimizers.
- one process: the optimizers' state dicts inline;
- cp / pp: every rank's own (``rank_states``, gathered on rank 0): a cp replica's or a pp stage's;
- dp: the *full* AdamW state of the sharded policy (`get_optimizer_state_dict` with
  ``full_state_dict``: the shards all-gathered, parameter by parameter), written by rank 0, and
  the replicated draft's optimizer from rank 0; under dp x pp one full state per stage, taken
  from the stage's first rank among the gathered ``rank_states``. Every rank reads the checkpoint file
  back and keeps its own shard. (`torch.distributed.checkpoint`, where each rank writes its own
  shard and no rank holds the whole state, is what a model too large for one host needs; not built.)
The weights come from the engine's synced copies when distributed (rank 0 holds a full one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cospec.models.integrity import NonFiniteError, nonfinite_names
from cospec.rl.checkpoint import as_tuples, copy_weights, save_checkpoint


def _sharded(trainer) -> bool:
    return trainer.group is not None and trainer.group.dp > 1


def _full_state_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def rank_state(trainer) -> dict:
    """This rank's optimizer states (under pp each stage has its own; under dp the policy's is
    the full one, a collective)."""
    if _sharded(trainer):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # Not cpu_offload: that keeps the state on *global* rank 0 only, which under dp x pp holds
        # no later stage. Every rank of the stage gets it whole for a moment (the price of a
        # full-state checkpoint) and keeps a CPU copy to send.
        policy_state = _to_cpu(get_optimizer_state_dict(trainer.policy, trainer.optimizer,
                                                        options=_full_state_options()))
    else:
        policy_state = trainer.optimizer.state_dict()
    state = {"optimizer": policy_state}
    if trainer.draft_optimizer is not None:
        state["draft_optimizer"] = trainer.draft_optimizer.state_dict()
    return state


def trainer_state(trainer) -> dict | None:
    """The step, the RNG states and the optimizers (module docstring); None off rank 0."""
    state = {"step": trainer.step, "torch_rng": torch.get_rng_state(),
             "prompt_rng": trainer.prompt_rng.getstate()}
    if trainer.group is None:
        return {**state, **rank_state(trainer)}
    if _sharded(trainer) and trainer.group.pp == 1:
        mine = rank_state(trainer)
        return {**state, **mine} if trainer.is_lead else None
    mine, group = rank_state(trainer), trainer.group
    if _sharded(trainer) and group.rank != group.stage * group.cp:
        mine = {}  # dp x pp: the stage's first rank sends the stage's full state, once
    ranks = group.gather(mine)
    return {**state, "rank_states": ranks} if trainer.is_lead else None


def save_trainer(trainer) -> None:
    """Atomic checkpoint of the full policy and draft (the engine's synced copies when
    distributed) and the trainer state; written by rank 0; a collective when distributed."""
    group = trainer.group
    policy = trainer.policy if group is None else trainer.rollout_policy
    draft = trainer.draft if group is None or group.pp == 1 else trainer.rollout_draft
    bad = []
    for name, model in (("policy", policy), ("draft", draft)) if trainer.is_lead else ():
        tensors = nonfinite_names(model.state_dict()) if model is not None else []
        if tensors:
            bad.append(f"the {name} ({', '.join(tensors[:3])})")
    if group is not None:  # every rank stops alike (rank 0 decides)
        bad = group.broadcast(bad)
    if bad:  # never a checkpoint that --resume would refuse
        raise NonFiniteError(f"GRPO step {trainer.step}: non-finite weights in "
                             f"{' and '.join(bad)}; not checkpointed")
    state = trainer_state(trainer)
    if trainer.is_lead:
        save_checkpoint(f"{trainer.out_dir}/checkpoints", trainer.step, policy=policy,
                        trainer_state=state, config=trainer.cfg.to_dict(), draft=draft,
                        keep=trainer.g.keep_checkpoints)
    if group is not None:  # no rank runs ahead of a checkpoint it might resume from
        dist.barrier()


@torch.no_grad()
def restore_trainer(trainer, ckpt: dict) -> None:
    """Every rank restores its part: the policy (or its stage, or its shard), the draft, its own
    optimizer states; a generating rank also its engine's copies."""
    st, group = ckpt["trainer_state"], trainer.group
    if _sharded(trainer):
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        names = trainer.policy.state_dict().keys()  # a pipeline stage's, or the whole policy's
        set_model_state_dict(trainer.policy, {k: v for k, v in ckpt["policy"].state_dict().items()
                                              if k in names}, options=_full_state_options())
        # dp x pp: the stage's full state was kept by its first rank (replica 0, cp rank 0)
        mine = st if group.pp == 1 else st["rank_states"][group.stage * group.cp]
        set_optimizer_state_dict(trainer.policy, trainer.optimizer, mine["optimizer"],
                                 options=_full_state_options())
        copy_weights(ckpt["policy"], [trainer.rollout_policy])
    else:
        copy_weights(ckpt["policy"], [trainer.policy, trainer.rollout_policy])
        mine = st["rank_states"][group.rank] if "rank_states" in st else st
        trainer.optimizer.load_state_dict(mine["optimizer"])
    if ckpt["draft"] is not None:
        copy_weights(ckpt["draft"], [trainer.draft, trainer.rollout_draft])
    if trainer.draft_optimizer is not None:
        trainer.draft_optimizer.load_state_dict(mine["draft_optimizer"])
    torch.set_rng_state(st["torch_rng"])
    trainer.prompt_rng.setstate(as_tuples(st["prompt_rng"]))
    trainer.step = st["step"]
