"""What a GRPO checkpoint holds and how every rank writes and restores its part of it.

A checkpoint (`cospec.rl.checkpoint`, atomic) holds the full policy and draft, the config, and the
trainer state: the step, the RNG states and the optimizers.
- one process: the optimizers' state dicts inline in trainer_state.pt;
- distributed (any mesh: dp, cp, pp and their products): the trained policy (its FSDP2 shards
  under dp, its stage under pp, a replica under cp) with its AdamW state, and the draft's
  optimizer, go through `torch.distributed.checkpoint` (DCP) into ``sharded/``: every rank writes
  its own part (no rank ever gathers the others'; the equal copies of cp ranks are written once,
  DCP's de-duplication of a key that several ranks save) into the checkpoint's staging directory,
  and only then does rank 0 rename it into place, so a kill leaves either the old or the new
  checkpoint. On resume every rank reads back its own part; the layout must be the same (the
  resume check compares the whole config, `parallel` included). Checkpoints of cp and pp runs
  from before 2026-12-05 hold every rank's optimizer states in trainer_state.pt
  (``rank_states``) and still resume.
The full policy in policy/ comes from the engine's synced copy when distributed (rank 0 holds one):
what `cospec eval` and `cospec export` read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from cospec.models.draft import TappedDraft
from cospec.models.integrity import NonFiniteError, nonfinite_names
from cospec.rl.checkpoint import (as_tuples, copy_weights, save_checkpoint, staging_dir,
                                 staging_path)


def trainer_state(trainer) -> dict | None:
    """The step, the RNG states and, on one process, the optimizers (distributed, they are in
    sharded/); None off rank 0."""
    state = {"step": trainer.step, "torch_rng": torch.get_rng_state(),
             "prompt_rng": trainer.prompt_rng.getstate()}
    if trainer.group is not None:
        return {**state, "sharded": True} if trainer.is_lead else None
    state["optimizer"] = trainer.optimizer.state_dict()
    if trainer.draft_optimizer is not None:
        state["draft_optimizer"] = trainer.draft_optimizer.state_dict()
    return state


def _dcp_state(trainer) -> dict:
    """The state DCP writes and reads in place: the policy's (or its stage's) parameters, sharded
    under dp, and AdamW state, and the draft's optimizer state where the draft trains (sharded
    like the policy's). Optimizer states are flattened to parameter-name keys, so that the stages'
    entries of a pipeline never collide (their layers keep the policy's indices)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"model": get_model_state_dict(trainer.policy),
             "optimizer": get_optimizer_state_dict(trainer.policy, trainer.optimizer, options=flat)}
    if trainer.draft_optimizer is not None:
        state["draft_optimizer"] = get_optimizer_state_dict(trainer.draft, trainer.draft_optimizer,
                                                            options=flat)
    return state


def _check_finite(trainer, policy, draft) -> None:
    """NonFiniteError on every rank if rank 0's copies hold a NaN or inf: never a checkpoint that
    --resume would refuse."""
    bad = []
    for name, model in (("policy", policy), ("draft", draft)) if trainer.is_lead else ():
        tensors = nonfinite_names(model.state_dict()) if model is not None else []
        if tensors:
            bad.append(f"the {name} ({', '.join(tensors[:3])})")
    if trainer.group is not None:  # every rank stops alike (rank 0 decides)
        bad = trainer.group.broadcast(bad)
    if bad:
        raise NonFiniteError(f"GRPO step {trainer.step}: non-finite weights in "
                             f"{' and '.join(bad)}; not checkpointed")


def save_trainer(trainer) -> None:
    """Atomic checkpoint of the full policy and draft (the engine's synced copies when
    distributed) and the trainer state; written by rank 0, with every rank's part in sharded/
    when distributed (a collective then)."""
    group = trainer.group
    policy = trainer.policy if group is None else trainer.rollout_policy
    # distributed, the draft's whole copy is the engine's (under dp and pp the trainer's is a
    # shard, or lives on another rank)
    draft = trainer.draft if group is None or (group.pp == 1 and group.dp == 1) else trainer.rollout_draft
    _check_finite(trainer, policy, draft)
    root = Path(f"{trainer.out_dir}/checkpoints")
    staged = None
    if group is not None:
        import torch.distributed.checkpoint as dcp

        staged = staging_path(root, trainer.step)
        if trainer.is_lead:
            staging_dir(root, trainer.step)
        dist.barrier()  # the staging directory exists before any rank writes into it
        dcp.save(_dcp_state(trainer), checkpoint_id=str(staged / "sharded"))
        dist.barrier()  # every rank's shards are written before rank 0 renames the directory
    state = trainer_state(trainer)
    if trainer.is_lead:
        save_checkpoint(root, trainer.step, policy=policy, trainer_state=state,
                        config=trainer.cfg.to_dict(), draft=draft, keep=trainer.g.keep_checkpoints,
                        staged=staged)
    if group is not None:  # no rank runs ahead of a checkpoint it might resume from
        dist.barrier()


@torch.no_grad()
def restore_trainer(trainer, ckpt: dict) -> None:
    """Every rank restores its part: the policy (or its stage, or its shards), the draft, its own
    optimizer states; a generating rank also its engine's copies."""
    st, group = ckpt["trainer_state"], trainer.group
    if st.get("sharded"):
        _restore_shards(trainer, ckpt["path"] / "sharded")
        copy_weights(ckpt["policy"], [trainer.rollout_policy])
    else:
        copy_weights(ckpt["policy"], [trainer.policy, trainer.rollout_policy])
        mine = st["rank_states"][group.rank] if "rank_states" in st else st  # an older cp/pp run
        trainer.optimizer.load_state_dict(mine["optimizer"])
        if trainer.draft_optimizer is not None:
            trainer.draft_optimizer.load_state_dict(mine["draft_optimizer"])
    if ckpt["draft"] is not None:
        copy_weights(ckpt["draft"], [trainer.rollout_draft])
        _load_whole(trainer.draft, ckpt["draft"])
        for draft in (trainer.draft, trainer.rollout_draft):  # no engine copy on cp/pp followers
            if isinstance(draft, TappedDraft):  # the scale is draft.json's, not a weight
                draft.proposal_scale = ckpt["draft"].proposal_scale
    torch.set_rng_state(st["torch_rng"])
    trainer.prompt_rng.setstate(as_tuples(st["prompt_rng"]))
    trainer.step = st["step"]


def _load_whole(module, source) -> None:
    """``source``'s whole tensors into ``module``, whose parameters may be FSDP2 shards (then each
    rank keeps its own)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        copy_weights(source, [module])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, source.state_dict(), options=StateDictOptions(full_state_dict=True))


def _restore_shards(trainer, path: Path) -> None:
    """Read this rank's shards (DCP loads into `_dcp_state`'s tensors in place) and set them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    state = _dcp_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    # The state dict's tensors may alias the live ones (then the load already put them in place);
    # setting them is what the API asks and what a copy (an offloaded state) needs.
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    set_model_state_dict(trainer.policy, state["model"])
    set_optimizer_state_dict(trainer.policy, trainer.optimizer, state["optimizer"], options=flat)
    if trainer.draft_optimizer is not None:
        set_optimizer_state_dict(trainer.draft, trainer.draft_optimizer, state["draft_optimizer"],
                                 options=flat)
