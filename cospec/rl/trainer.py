"""The GRPO loop: a sequence of named steps, each a small method.

    generate -> score -> compute_advantages -> train_policy -> train_draft (draft/cotrain.py)
             -> sync_weights -> log -> checkpoint

Rollouts come from the engine (`GenerationEngine`, or `SpeculativeEngine` with the draft when
``rollout.speculative``), which runs on its *own copy* of the policy; `sync_weights` pushes the
trainer's weights to it through the `WeightSync` seam after every update (in-process copy here).

Data contract of one step (`RolloutBatch`), rollouts of a prompt contiguous, worked example with
prompts_per_step = 2, group_size = 2: examples [e0, e0, e1, e1]; completions in the same order;
rewards [1, 0, 0, 0]; advantages (mean_std) [1, -1, 0, 0]; the e1 group has equal rewards, so its
advantages are 0 and it adds no gradient.

Reproducibility: the prompt stream is a `random.Random` whose state is checkpointed, and rollout k
of step s draws from its own seed (`rollout_seed(grpo.seed, s, k)`, per-prompt streams in the
engine): a resumed run repeats an uninterrupted one, and dp replicas sample what one process does
(bit-exact on CPU with plain or fixed-gamma rollouts; the adaptive controller picks gamma from
measured wall-clock costs, so with it runs are equal in distribution, not bit for bit).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from cospec.config import ConfigError, DraftConfig, RunConfig, SamplingConfig
from cospec.data.prompts import TaskData
from cospec.data.tasks import Example
from cospec.data.tokenizer import Tokenizer, check_vocab
from cospec.draft.cotrain import cotrain_config, cotrain_draft, cotrain_sampler
from cospec.draft.offline import trainable_parameters, train_draft_offline
from cospec.draft.ttt import TTTBatch
from cospec.metrics.progress import progress_bar
from cospec.metrics.run_log import RunLog
from cospec.models.integrity import NonFiniteError, nonfinite_names
from cospec.models.loading import inference_copy
from cospec.parallel.data_parallel import all_reduce_sum, local_tensor
from cospec.parallel.tensor_transfer import broadcast_draft_metrics, broadcast_rollouts
from cospec.rl import grpo
from cospec.rl.checkpoint import check_resumable, latest_checkpoint, load_latest_good
from cospec.rl.dp_step import replica_chunks, replicas_view
from cospec.rl.layouts import build_policy_layout, check_rl_config
from cospec.rl.policy_step import PolicyMinibatch, metrics_from_sums
from cospec.rl.step_metrics import console_line, step_metrics
from cospec.rl.trainer_state import restore_trainer, save_trainer
from cospec.rollout.engine import Completion, GenerationEngine
from cospec.rollout.prompt_streams import rollout_seed
from cospec.rollout.speculative import SpeculativeEngine


@dataclass
class RolloutBatch:
    """examples / completions: one per rollout (R = prompts_per_step * group_size, or this
    replica's share under data parallelism); rewards, advantages: float [R]; generate_seconds:
    wall time of the engine call; stats: the engine's speculation statistics (None for plain
    rollouts); first: the step-wide index of the first rollout (0 but on replicas after the
    first); replicas: the step's rollouts over every replica, for the log (`replicas_view`)."""

    examples: list[Example]
    completions: list[Completion]
    rewards: torch.Tensor
    advantages: torch.Tensor | None
    generate_seconds: float
    num_tokens: int
    stats: object | None = None
    first: int = 0
    replicas: dict | None = None


class GRPOTrainer:
    """GRPO on one process, or on every rank of a `TrainGroup` (``group``; see
    `cospec.parallel.train_group` for who does what). Every rank constructs it with the full
    policy and draft; under pp each keeps its stage."""

    def __init__(self, cfg: RunConfig, policy, *, draft=None, tokenizer: Tokenizer | None = None,
                 out_dir=None, tensorboard: bool = True, group=None):
        """tokenizer: the policy's (default: `load_tokenizer(cfg.model)`, the character tokenizer
        for the embedded model); prompts come from ``task.source`` through it (`TaskData`)."""
        from cospec.models.loading import load_tokenizer

        check_rl_config(cfg)
        tokenizer = tokenizer or load_tokenizer(cfg.model)
        check_vocab(policy.config.vocab_size, tokenizer)
        self.data = TaskData.from_config(cfg.task, tokenizer)
        self.data.check_room(policy.config.max_seq_len)
        self.cfg, self.g, self.group = cfg, cfg.grpo, group
        self.out_dir = out_dir or f"{cfg.out_dir}/rl"
        self.device = next(policy.parameters()).device
        self.is_lead = group is None or group.is_lead  # evaluates, logs, writes checkpoints
        self.generates = group is None or group.generates  # owns a rollout engine
        self.owns_draft = group is None or group.owns_draft
        # The engine runs on its own copy of the policy (and of the draft), synced after updates
        # through the WeightSync seam; frozen and oracle drafts go through the same path.
        dtype = cfg.rollout.dtype
        self.rollout_policy = inference_copy(policy, dtype) if self.generates else None
        self.rollout_draft = (inference_copy(draft, dtype)
                              if draft is not None and self.generates else None)
        self.draft = draft  # the trainer's draft, updated by co-training (on its owner rank)
        self.draft_optimizer = None
        cotrains = draft is not None and cfg.draft.mode == "cotrain" and self.owns_draft
        if cotrains:
            trainable_parameters(draft, cfg)  # sets requires_grad, before any sharding
        self._draft_data: list[TTTBatch] = []
        self._step_examples: list[Example] = []  # the step's examples over every replica (generate)
        layout = build_policy_layout(cfg, policy, group=group, draft=draft,
                                     rollout_policy=self.rollout_policy,
                                     rollout_draft=self.rollout_draft)
        self.policy, self.reference, self.optimizer = layout.policy, layout.reference, layout.optimizer
        self.policy_step, self.weight_sync, self.draft_sync = (layout.policy_step, layout.weight_sync,
                                                               layout.draft_sync)
        self.draft_loss, self.reduce_draft_grads = layout.draft_loss, layout.reduce_draft_grads
        if cotrains:  # after the layout: under dp the draft's parameters are FSDP2 shards now
            self.draft_optimizer = torch.optim.AdamW(
                [p for p in draft.parameters() if p.requires_grad], lr=cfg.draft.cotrain_lr,
                betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        self.prompt_rng = random.Random(cfg.task.seed * 7919 + self.g.seed)
        self.engine = self.make_engine() if self.generates else None
        self.step = 0
        self.tensorboard = tensorboard
        self._step_start_rng, self._updated_this_step = None, False  # see `_stopped`

    def make_engine(self, *, plain: bool = False):
        """The rollout engine the config asks for; ``plain``: a plain one whatever it asks."""
        r, batch, stop_ids = self.cfg.rollout, self.cfg.sampling.batch_size, self.data.tokenizer.stop_ids
        if plain or not r.speculative:
            return GenerationEngine(self.rollout_policy, batch_size=batch, stop_ids=stop_ids,
                                    compile=r.compile)
        if self.draft is None:
            raise ConfigError("rollout.speculative: needs a draft (cospec draft-train makes one)")
        return SpeculativeEngine(self.rollout_policy, self.rollout_draft, batch_size=batch, gamma=r.gamma,
                                 adaptive=r.adaptive, probe_every=r.probe_every, stop_ids=stop_ids,
                                 overshoot_every=r.overshoot_every, compile=r.compile)

    # ------------------------------------------------------------------------- the named steps

    def rollout_sampling(self) -> SamplingConfig:
        """What rollouts sample with: the run's temperature and response cap (no top-k/p in RL)."""
        s = self.cfg.sampling
        return SamplingConfig(temperature=s.temperature, max_new_tokens=s.max_new_tokens)

    def generate(self) -> RolloutBatch:
        """Sample prompts_per_step prompts, answer each group_size times (under dp: every replica
        draws all the prompts, the same ones, and answers its share of the groups). Rollout k of
        the step draws from its own seed (`rollout_seed`), so its tokens do not depend on which
        replica, batch or slot answered it."""
        G, dp = self.g.group_size, self.group.dp if self.group is not None else 1
        share = self.g.prompts_per_step // dp
        dp_rank = self.group.dp_rank if self.group is not None else 0
        mine = range(dp_rank * share, (dp_rank + 1) * share)
        self._step_examples, examples, prompts = [], [], []
        for i in range(self.g.prompts_per_step):
            ex = self.data.source.sample(self.prompt_rng)
            self._step_examples += [ex] * G
            if i in mine:  # rendered once per group (a chat template is not free)
                examples += [ex] * G
                prompts += [self.data.prompt_ids(ex)] * G
        first = mine.start * G
        sampling = self.rollout_sampling()
        seeds = [rollout_seed(self.g.seed, self.step, first + k) for k in range(len(prompts))]
        try:
            result = self.engine.generate(prompts, sampling, seeds=seeds)
        except NonFiniteError as e:
            raise NonFiniteError(f"GRPO step {self.step + 1}, rollouts: {e}") from e
        return RolloutBatch(examples=examples, completions=result.completions, rewards=None,
                            advantages=None, generate_seconds=result.seconds,
                            num_tokens=result.num_tokens, stats=getattr(result, "stats", None),
                            first=first)

    def score(self, batch: RolloutBatch) -> None:
        rewards = []
        for ex, c in zip(batch.examples, batch.completions):
            if self.g.require_eos and c.finish_reason != "eos":
                rewards.append(0.0)
            else:
                rewards.append(self.data.reward(ex, c.tokens))
        batch.rewards = torch.tensor(rewards)

    def compute_advantages(self, batch: RolloutBatch) -> None:
        batch.advantages = grpo.group_advantages(batch.rewards, self.g.group_size, self.g.advantage)

    def train_policy(self, batch: RolloutBatch) -> dict:
        """micro_steps optimizer steps over minibatches of the rollouts (old logprobs: the
        rollout's), each through the policy step of the run's layout. Returns the loss, clip, KL,
        entropy and grad-norm means over minibatches, and the train/inference mismatch of the first
        (before any update of this step: trainer vs rollout engine, same weights)."""
        chunks = replica_chunks(batch.first, len(batch.completions), self.g.micro_steps)
        tap_layers = self.draft.tap_layers if self._cotrain_now() else ()
        d, seed = self._cotrain_budget()  # the policy step captures only what the draft trains on
        choose = cotrain_sampler(d, len(chunks), seed) if tap_layers and self.owns_draft else None
        logs = []
        for i, idx in enumerate(chunks):
            mb = PolicyMinibatch.from_rollouts(batch.completions, batch.advantages, idx)
            keep = choose((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()) if choose else None
            try:
                sums, grad_norm, captured = self.policy_step(mb, tap_layers, keep)
            except NonFiniteError as e:
                raise NonFiniteError(f"GRPO step {self.step + 1}, minibatch {i + 1} of "
                                     f"{len(chunks)}: {e}") from e
            self._updated_this_step = True
            self._draft_data += captured
            logs.append(metrics_from_sums(sums, grad_norm))
        mismatch = [k for k in logs[0] if k.startswith("mismatch")]
        out = {k: sum(l[k] for l in logs) / len(logs) for k in logs[0] if k not in mismatch}
        out.update({k: logs[0][k] for k in mismatch})
        return out

    def _cotrain_now(self) -> bool:
        # From the config, not from this rank's optimizer: under pp every stage must agree.
        return (self.draft is not None and self.cfg.draft.mode == "cotrain"
                and (self.step + 1) % self.cfg.draft.cotrain_every == 0)

    def train_draft(self) -> dict:
        """Co-training: the TTT loss on this step's captured features (``cotrain``); or, every
        oracle_every steps, an offline retrain on fresh samples of the current policy (``oracle``)."""
        d = self.cfg.draft
        if not self.owns_draft:  # pp: the draft trains on the last stage
            return {}
        if d.mode == "oracle" and (self.step + 1) % d.oracle_every == 0:
            _, m = train_draft_offline(self.cfg, self.policy.eval(), draft=self.draft, data=self.data,
                                       progress=False, evaluate=False)
            self.policy.train()
            return {"draft_loss": m["final_loss"], "draft_acceptance_tf": m["last_batch"].get("acceptance")}
        if not self._draft_data:
            return {}
        d, seed = self._cotrain_budget()
        metrics = cotrain_draft(self.draft, self.draft_optimizer, self._draft_data, d,
                                temperature=self.cfg.sampling.temperature, seed=seed,
                                loss_fn=self.draft_loss, reduce_grads=self.reduce_draft_grads)
        self._draft_data = []
        return metrics

    def _cotrain_budget(self) -> tuple[DraftConfig, int]:
        """This step's co-training config (`cotrain_config`) and seed."""
        return cotrain_config(self.cfg.draft, self.group), self.g.seed * 1_000_003 + self.step

    def evaluate(self) -> dict:
        """Mean reward on a fixed held-out prompt set (a seed the training stream never uses),
        sampled at the rollout temperature with a fixed generator: a paired measure across steps
        and runs, unlike the per-step training reward, whose prompts change every step."""
        rng = random.Random(999_331)
        examples = [self.data.source.sample(rng) for _ in range(self.g.eval_prompts)]
        result = self.engine.generate([self.data.prompt_ids(e) for e in examples],
                                      self.rollout_sampling(),
                                      generator=torch.Generator(device=self.device).manual_seed(4242))
        batch = RolloutBatch(examples=examples, completions=result.completions, rewards=None,
                             advantages=None, generate_seconds=result.seconds, num_tokens=result.num_tokens)
        self.score(batch)
        fam: dict[str, list[float]] = {}
        for ex, r in zip(examples, batch.rewards.tolist()):
            fam.setdefault(ex.family, []).append(r)
        return {"eval_reward": float(batch.rewards.mean()),
                "eval_reward_by_family": {k: sum(v) / len(v) for k, v in sorted(fam.items())}}

    def sync_weights(self) -> None:
        """The trained weights to the engine's copies (a collective under pp: the stages' weights
        of cp column 0 are gathered on the rollout rank; cp replicas are equal, so under cp alone
        rank 0 copies its own)."""
        if self.weight_sync is not None:
            self.weight_sync.push(self.policy)
        if self.draft_sync is not None and self.cfg.draft.mode != "frozen":
            if self.owns_draft:  # a draft with a NaN would stop the next rollout: say so now
                bad = self._draft_nonfinite()
                if bad:
                    raise NonFiniteError(f"GRPO step {self.step + 1}: the co-trained draft has "
                                         f"non-finite weights ({', '.join(bad[:3])}); it is not "
                                         f"synced to the rollout engine")
            self.draft_sync.push(self.draft)

    def _draft_nonfinite(self) -> list[str]:
        """Names of the trained draft's non-finite tensors. A sharded draft (dp) is checked where
        its shards live and the verdict summed over its trainers: a count, not a gather of the
        draft (the sync that follows gathers it once)."""
        bad = nonfinite_names({k: local_tensor(v) for k, v in self.draft.state_dict().items()})
        if self.group is not None and self.group.dp > 1:
            trainers = self.group.stage_group if self.group.pp > 1 else None  # None: the world
            if all_reduce_sum(torch.tensor(float(len(bad))), trainers) and not bad:
                bad = ["a shard on another rank"]
        return bad

    # ------------------------------------------------------------------------- run, save, resume

    def run_step(self) -> dict | None:
        """One GRPO step; its metrics on the rollout rank (None on the other ranks)."""
        t0 = time.perf_counter()
        # What a checkpoint of the state before this step holds, should the step fail (`_stopped`)
        self._step_start_rng = (torch.get_rng_state(), self.prompt_rng.getstate())
        self._updated_this_step = False
        batch = self.last_batch = self.generate() if self.generates else None
        t1 = time.perf_counter()
        if batch is not None:
            self.score(batch)
            self.compute_advantages(batch)
        if self.group is not None and self.group.replica_size > 1:  # the rollouts to the replica
            shared = broadcast_rollouts(
                (batch.completions, batch.advantages, batch.rewards, batch.first) if batch else None,
                src=self.group.replica_first_rank, group=self.group.replica_collectives)
            if batch is None:
                batch = RolloutBatch(examples=[], completions=shared[0], rewards=shared[2],
                                     advantages=shared[1], generate_seconds=0.0, num_tokens=0,
                                     first=shared[3])
        if self.group is not None and self.group.dp > 1:  # the log's step-wide figures
            batch.replicas = replicas_view(self._step_examples, batch.rewards, batch.completions,
                                           group=self.group.dp_group)
        t2 = time.perf_counter()
        train = self.train_policy(batch)
        t3 = time.perf_counter()
        draft_metrics = self.train_draft()
        if self.group is not None and self.group.draft_rank not in (None, 0):
            draft_metrics = broadcast_draft_metrics(draft_metrics, src=self.group.draft_rank,
                                                    ttt_steps=self.cfg.draft.ttt_steps)
        train.update(draft_metrics)
        t4 = time.perf_counter()
        self.sync_weights()
        t5 = time.perf_counter()
        self.step += 1
        if not self.is_lead:
            return None
        return step_metrics(batch, train, {"generate": t1 - t0, "train_policy": t3 - t2,
                                           "train_draft": t4 - t3, "other": (t2 - t1) + (t5 - t4)},
                            replicas=batch.replicas)

    def save(self) -> None:
        """Atomic checkpoint of the full policy, the draft and the trainer state
        (`cospec.rl.trainer_state.save_trainer`; a collective when distributed)."""
        save_trainer(self)

    def restore(self, ckpt: dict) -> None:
        """Every rank restores its part (`cospec.rl.trainer_state.restore_trainer`)."""
        restore_trainer(self, ckpt)

    def run(self, *, resume: bool = False, progress: bool = True, on_step=None) -> list[dict]:
        """Train until grpo.steps; with `resume`, continue from the latest checkpoint. Distributed:
        every rank calls it; the rollout rank evaluates, logs and returns the history."""
        resume_step = None
        if resume:
            warn = print if self.is_lead else (lambda _: None)
            found = load_latest_good(f"{self.out_dir}/checkpoints", device=self.device, warn=warn)
            if found is not None:
                path, ckpt = found
                check_resumable(self.cfg, ckpt["config"])
                self.restore(ckpt)
                resume_step = self.step
                warn(f"resumed from {path} (step {self.step})")
        try:
            return self._run(resume_step, progress, on_step)
        except NonFiniteError as e:
            raise NonFiniteError(f"{e}. {self._stopped()}") from e

    def _stopped(self) -> str:
        """After a non-finite loss, gradient or draft: keep the last good state, say where it is.
        Before the step's first update (single process) the weights are still the previous step's:
        they are checkpointed with that step's RNG states, so --resume repeats the failed step
        exactly (to inspect it, or after changing the config). Otherwise the newest checkpoint on
        disk is the last good one."""
        if self.group is None and self._step_start_rng is not None and not self._updated_this_step:
            torch.set_rng_state(self._step_start_rng[0])
            self.prompt_rng.setstate(self._step_start_rng[1])
            try:
                self.save()  # refuses non-finite weights (a NaN that came in some other way)
                return (f"The state before the failed step (step {self.step}) is checkpointed in "
                        f"{self.out_dir}/checkpoints; cospec train --resume continues from it")
            except NonFiniteError:
                pass
        last = latest_checkpoint(f"{self.out_dir}/checkpoints")
        return (f"The newest good checkpoint is {last}" if last is not None
                else "No checkpoint was written before it")

    def _run(self, resume_step, progress, on_step) -> list[dict]:
        if not self.is_lead:
            while self.step < self.g.steps:
                self.run_step()
                if self.step % self.g.checkpoint_every == 0 or self.step == self.g.steps:
                    self.save()
            return []
        log = RunLog(f"{self.out_dir}/metrics.jsonl",
                     f"{self.out_dir}/tb" if self.tensorboard else None, resume_step=resume_step)
        history = []
        try:
            if self.step == 0 and self.g.eval_every:
                log.log(0, self.evaluate())
            with progress_bar(progress, self.g.steps, "grpo", start=self.step) as advance:
                while self.step < self.g.steps:
                    metrics = self.run_step()
                    if self.g.eval_every and (self.step % self.g.eval_every == 0
                                              or self.step == self.g.steps):
                        metrics.update(self.evaluate())
                    log.log(self.step, metrics)
                    history.append(metrics)
                    if self.step % self.g.checkpoint_every == 0 or self.step == self.g.steps:
                        self.save()
                    if on_step is not None:
                        on_step(self.step, metrics)
                    advance(console_line(metrics))
        finally:
            log.close()
        return history
