"""The sections of the run config that train: the draft, the rollout engine, GRPO and the
parallel layout."""

from __future__ import annotations

from dataclasses import dataclass

from cospec.config.sections import _check


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    #: "eagle3" (one decoder layer on the policy's tapped features, drafting a token per
    #: forward), "block" (a small stack on the same features drafting the whole block in one
    #: forward, DFlash style) or "lm" (a standalone small causal LM)
    kind: str = "eagle3"
    #: policy layers whose outputs the eagle3 or block draft reads (low, mid, high; empty = 1, L/2-1, L-4)
    tap_layers: tuple[int, ...] = ()
    #: decoder layers of the block draft (chosen by measurement: docs/results/block_drafter.md)
    block_layers: int = 1
    #: block draft: DSpark's sequential correction (each position told the token drafted before
    #: it; its heads then run one position at a time). Off by default: on the long workload it
    #: made drafting 1.9x dearer from gamma 2 to 8 and tau no higher; on SmolLM2 it lifts block
    #: positions 2-4 from ~0.13 to ~0.39 acceptance: turn it on for a real model
    #: (docs/results/block_drafter.md)
    block_correction: bool = False
    #: block draft: DSpark's confidence head, from which the adaptive controller picks how many of
    #: the drafted tokens to verify
    block_confidence: bool = True
    #: SwiGLU inner size of the draft layer(s) (0 = the policy's)
    intermediate_size: int = 0
    #: eagle3: rows of the draft's LM head, the most frequent tokens of the policy's own samples
    #: (EAGLE-3's reduced draft vocabulary; q = 0 elsewhere, sampling stays lossless); 0 = the
    #: policy's whole vocabulary. Fixed when the draft is first trained offline
    vocab_size: int = 0
    #: decoder layers of the eagle3 draft: the first reads the token and the feature (EAGLE-3's
    #: layer), the others are plain decoder layers on its output; each step's hidden is the
    #: last layer's. EAGLE-3 has one; more buy acceptance with draft time (on SmolLM2 a second
    #: layer gave +2.5-2.8% tau at 256 answers for 5-11% more step time: docs/results/real_model.md)
    eagle3_layers: int = 1
    #: decoder layers of the "lm" draft
    lm_num_layers: int = 1
    #: copy the policy's embedding and LM head into the draft at construction
    init_from_policy: bool = True
    #: eagle3: also start the draft's decoder layers as copies of the policy's layers after the
    #: high tap, fc passing the high tap through (`Eagle3Draft.copy_layer_from_policy`; needs
    #: intermediate_size 0). On SmolLM2 it raised held-out acceptance by ~0.07 at every TTT step
    #: (tau 1.71 -> 1.88); on the embedded 6-layer policy it lowered tau (2.76 -> 2.61), so it is
    #: the smollm2-math recipe's choice, not the default (docs/results/real_model.md)
    layer_from_policy: bool = False
    #: keep the draft's (copied) input embedding fixed in offline training and co-training
    #: (EAGLE-3 shares the target's; on a 49K vocabulary it is most of the draft's parameters and
    #: overfits a few thousand samples)
    freeze_embedding: bool = False
    #: offline training (`cospec draft-train`): optimizer steps
    train_steps: int = 300
    #: offline training: tokens per packed batch
    tokens_per_batch: int = 2048
    #: offline training: peak learning rate (AdamW, warmup then cosine)
    lr: float = 2e-3
    #: offline training: prompts the policy answers to make the training data (kept in
    #: out_dir/draft_answers: a later draft-train with the same policy and sampling reuses them,
    #: and one with more prompts makes only the new answers)
    num_train_prompts: int = 1024
    #: offline training: rows of the engine that samples those answers (0 = sampling.batch_size).
    #: Each answer draws from its own prompt's random stream, so this changes the speed only (on
    #: SmolLM2 in fp32, batch 64 sampled the same 128 answers 1.38x as fast as batch 16:
    #: docs/results/real_model.md)
    answer_batch_size: int = 0
    #: offline training: held-out prompts (a prompt stream of their own) whose answers measure the
    #: draft's teacher-forced acceptance as it trains; 0 = none
    num_eval_prompts: int = 64
    #: offline training: hold the policy's taps and logits of every training batch, computed once
    #: up front (~40 KB a token for SmolLM2 with an 8K head: 11 GB for 2,048 of its answers);
    #: false recomputes a batch's policy forward whenever training draws it (one batch in
    #: memory, for answer sets past it; each read then costs a forward). Same draft either way
    keep_policy_outputs: bool = True
    #: offline training: measure that held-out acceptance every this many steps (and at the end;
    #: 0 = only at the end)
    eval_every: int = 100
    #: offline training: keep the draft and its optimizer in out_dir every this many steps, so an
    #: interrupted draft-train resumes there (0 = never)
    checkpoint_every: int = 100
    #: training-time-test unroll depth (EAGLE-3): steps ahead the draft is trained for; for the
    #: block draft, the block positions trained (set it to rollout.gamma)
    ttt_steps: int = 3
    #: loss weight of TTT step (or block position) j is ttt_decay^(j-1)
    ttt_decay: float = 0.8
    #: torch manual seed of draft init and training
    seed: int = 0
    #: with speculative rollouts: "frozen" (the offline draft, never updated), "cotrain" (trained
    #: every cotrain_every RL steps on that step's policy features), "oracle" (retrained offline on
    #: the current policy every oracle_every steps: a measurement, not a method)
    mode: str = "frozen"
    #: co-training: train the draft every this many RL steps
    cotrain_every: int = 1
    #: co-training: draft optimizer steps per RL step (one pass over the step's minibatches each)
    cotrain_iters: int = 1
    #: co-training: AdamW learning rate of the draft (1e-3 lowered tau in the first steps:
    #: docs/results/cotrain.md)
    cotrain_lr: float = 1e-4
    #: co-training: the draft trains on at most this many of each step's tokens (whole sequences,
    #: a random subset of each minibatch; 0 = all): its cost grows with them (on the demo, 1024 of
    #: a step's ~3.3K tokens cost 9% of the step, 2048 cost 20%, with the same tau kept)
    cotrain_max_tokens: int = 1024
    #: draft loss mix, offline and co-training alike: (1 - tv_weight) x soft cross-entropy +
    #: tv_weight x total variation (0 = cross-entropy only, 1 = total variation only)
    tv_weight: float = 0.0
    #: draft loss weights, offline and co-training alike: the unroll from entry t weighs
    #: 1 + anchor_weight x P(s_t was the residual draw after a rejection), so that training
    #: weighs each place roughly as often as decoding drafts from it (0 = uniform;
    #: docs/design.md, "Where drafting starts"). A 480-step fine-tune at 4 did not change a
    #: SmolLM2 draft's expected tau (docs/results/real_model.md). Not under parallel.cp > 1 yet
    anchor_weight: float = 0.0
    #: mixed precision of the draft's training forwards (offline and co-training) and of
    #: offline training's policy forward that makes its targets: "" (fp32) or "bfloat16"
    #: (torch.autocast; weights and optimizer state stay fp32, the trunk + branch attention and
    #: the losses stay fp32). Halves the cost on GPUs and AMX CPUs (a recomputed SmolLM2 batch
    #: 1.6x cheaper, the same expected tau to 3 decimals); 30x dearer on CPUs without bf16
    #: matmul units (docs/results/real_model.md)
    autocast: str = ""
    #: on a CPU, offline and co-training batches are padded to a multiple of this many tokens
    #: (one untrained sequence appended; 0 or 1 = off; never on a GPU or under cp): there each
    #: new matmul shape costs a kernel build (~7 ms a bf16 matmul), and batches of whole
    #: sequences rarely repeat a token count. Same loss and gradients (ttt.pad_to_bucket)
    token_bucket: int = 32
    #: offline training ends by fitting the draft's proposal scale (q = softmax(scale x logits /
    #: T) when it drafts; lossless whatever the scale) to the most expected tau at rollout.gamma
    #: on its held-out answers; needs draft.num_eval_prompts > 0 and temperature sampling without
    #: top-k/top-p. A saved draft keeps its scale when reused (drafts saved before it: 1.0), also
    #: at another gamma; off, a reused draft proposes at 1. A block draft's confidence head
    #: still estimates acceptance at scale 1 (docs/design.md, "The proposal scale")
    fit_proposal_scale: bool = True
    #: oracle mode: retrain the draft on the current policy every this many RL steps
    oracle_every: int = 10

    def __post_init__(self) -> None:
        _check(self.mode in ("frozen", "cotrain", "oracle"), "draft.mode",
               f"must be frozen, cotrain or oracle, got {self.mode!r}")
        _check(self.cotrain_every > 0, "draft.cotrain_every", "must be positive")
        _check(self.cotrain_iters > 0, "draft.cotrain_iters", "must be positive")
        _check(self.cotrain_lr > 0, "draft.cotrain_lr", "must be positive")
        _check(self.cotrain_max_tokens >= 0, "draft.cotrain_max_tokens", "must be >= 0")
        _check(0 <= self.tv_weight <= 1, "draft.tv_weight", f"must be in [0, 1], got {self.tv_weight}")
        _check(self.anchor_weight >= 0, "draft.anchor_weight", f"must be >= 0, got {self.anchor_weight}")
        _check(self.oracle_every > 0, "draft.oracle_every", "must be positive")
        _check(self.token_bucket >= 0, "draft.token_bucket",
               f"must be >= 0, got {self.token_bucket}")
        _check(self.autocast in ("", "bfloat16"), "draft.autocast",
               f"must be empty (fp32) or bfloat16, got {self.autocast!r}")
        _check(self.kind in ("eagle3", "block", "lm"), "draft.kind",
               f"must be eagle3, block or lm, got {self.kind!r}")
        _check(self.block_layers > 0, "draft.block_layers", "must be positive")
        _check(len(self.tap_layers) in (0, 3), "draft.tap_layers",
               f"must name 3 layers (low, mid, high) or none for the default, got {list(self.tap_layers)}")
        _check(all(t >= 0 for t in self.tap_layers), "draft.tap_layers", "must be >= 0")
        _check(self.intermediate_size >= 0, "draft.intermediate_size", "must be >= 0")
        _check(self.vocab_size >= 0, "draft.vocab_size", f"must be >= 0, got {self.vocab_size}")
        _check(self.vocab_size == 0 or self.kind != "lm", "draft.vocab_size",
               "a reduced draft vocabulary is for draft.kind=eagle3 or block (set 0 for lm)")
        _check(self.lm_num_layers > 0, "draft.lm_num_layers", "must be positive")
        _check(self.eagle3_layers > 0, "draft.eagle3_layers", "must be positive")
        _check(not self.layer_from_policy or (self.kind == "eagle3" and self.init_from_policy
                                              and self.intermediate_size == 0),
               "draft.layer_from_policy", "copies a policy layer into the eagle3 draft: it needs "
               "draft.kind=eagle3, draft.init_from_policy=true and draft.intermediate_size=0")
        for n in ("answer_batch_size", "num_eval_prompts", "eval_every", "checkpoint_every"):
            _check(getattr(self, n) >= 0, f"draft.{n}", f"must be >= 0, got {getattr(self, n)}")
        for n in ("train_steps", "tokens_per_batch", "num_train_prompts", "ttt_steps"):
            _check(getattr(self, n) > 0, f"draft.{n}", f"must be positive, got {getattr(self, n)}")
        _check(self.lr > 0, "draft.lr", f"must be positive, got {self.lr}")
        _check(0 < self.ttt_decay <= 1, "draft.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    #: speculative rollouts (a draft proposes, the policy verifies; lossless)
    speculative: bool = False
    #: draft tokens per step: the fixed gamma, or the largest the adaptive controller may pick
    gamma: int = 4
    #: choose gamma (0 = plain decoding) every step from the online cost model
    adaptive: bool = True
    #: adaptive: after this many steps at gamma = 0, draft once to refresh the acceptance estimate
    #: (then after twice as many, up to 16 times as many, while speculation stays off)
    probe_every: int = 16
    #: weight dtype of the engine's copies of the policy and the draft: "" (model.dtype), "float32"
    #: or "bfloat16". Training keeps model.dtype; the copies are cast at every weight sync (as RL
    #: stacks run vLLM in bf16 beside an fp32 trainer). On CPUs with AMX, bf16 makes a forward of
    #: 5 tokens cost about one token's (docs/results/real_model.md)
    dtype: str = ""
    #: the overshoot diagnostics (q above p on drafted tokens) sum every this many drafting steps
    #: (they read p and q over the whole vocabulary: costly at large batch and vocabulary)
    overshoot_every: int = 4
    #: run the whole-batch decode, verification and one-token draft forwards as torch.compile
    #: graphs (`cospec.rollout.compiled_forward`; the first forward of each shape compiles,
    #: seconds each). null: the measured default of the device (`compile_rollouts`)
    compile: bool | None = None

    def __post_init__(self) -> None:
        _check(1 <= self.gamma <= 16, "rollout.gamma", f"must be in [1, 16], got {self.gamma}")
        _check(self.overshoot_every >= 1, "rollout.overshoot_every", "must be >= 1")
        _check(self.dtype in ("", "float32", "bfloat16"), "rollout.dtype",
               f"must be empty (model.dtype), float32 or bfloat16, got {self.dtype!r}")
        _check(self.probe_every > 0, "rollout.probe_every", "must be positive")


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    #: RL steps (one rollout batch each); the default is the demo's budget (~2 min a mode on 2
    #: CPU cores); every command, the demo included, takes it from the config
    steps: int = 20
    #: prompts per step; each is answered group_size times
    prompts_per_step: int = 8
    #: rollouts per prompt (the group whose rewards normalise the advantage)
    group_size: int = 8
    #: "mean_std" (GRPO) or "mean" (Dr. GRPO): how rewards become advantages within a group
    advantage: str = "mean_std"
    #: AdamW learning rate (constant; 1e-4 moved the default policy away and lowered reward)
    lr: float = 5e-5
    #: AdamW weight decay
    weight_decay: float = 0.0
    #: lower clip range of the importance ratio (1 - clip_low)
    clip_low: float = 0.2
    #: upper clip range of the importance ratio (1 + clip_high; DAPO's clip-higher)
    clip_high: float = 0.28
    #: weight of the KL(policy || initial policy) penalty (0 = off; the KL is logged either way)
    kl_coef: float = 0.0
    #: mixed precision of the policy step's forwards: "" (off) or "bfloat16" (torch.autocast;
    #: weights and optimizer state stay model.dtype). Single-process and cp layouts
    autocast: str = ""
    #: with kl_coef = 0, still forward the initial policy to log kl_from_init (on request: that
    #: forward is a quarter of a policy step's compute); off, kl_from_init is NaN. With
    #: kl_coef > 0 the KL is computed and logged either way. Single-process and cp layouts (the
    #: pipeline always runs its reference pass). The embedded default recipe asks for it
    log_kl: bool = False
    #: optimizer steps per rollout batch (the batch is split into this many minibatches)
    micro_steps: int = 1
    #: gradient clipping by global norm (0 = off)
    grad_clip: float = 1.0
    #: a response that ends without EOS (cut by max_new_tokens) earns 0 reward
    require_eos: bool = True
    #: save a checkpoint every this many steps (and at the end)
    checkpoint_every: int = 10
    #: checkpoints kept on disk (oldest deleted first)
    keep_checkpoints: int = 2
    #: seed of the RL run (rollout sampling, prompt stream)
    seed: int = 0
    #: evaluate on held-out prompts at step 0 and every this many steps (0 = never)
    eval_every: int = 10
    #: held-out prompts of that evaluation (sampled at the rollout temperature, fixed seed)
    eval_prompts: int = 256

    def __post_init__(self) -> None:
        _check(self.eval_every >= 0, "grpo.eval_every", "must be >= 0")
        _check(self.eval_prompts > 0, "grpo.eval_prompts", "must be positive")
        for n in ("steps", "prompts_per_step", "micro_steps", "checkpoint_every", "keep_checkpoints"):
            _check(getattr(self, n) > 0, f"grpo.{n}", f"must be positive, got {getattr(self, n)}")
        _check(self.group_size >= 2, "grpo.group_size",
               f"must be >= 2 (advantages compare rollouts of one prompt), got {self.group_size}")
        _check(self.advantage in ("mean_std", "mean"), "grpo.advantage",
               f"must be mean_std or mean, got {self.advantage!r}")
        _check(self.lr > 0, "grpo.lr", f"must be positive, got {self.lr}")
        _check(self.weight_decay >= 0, "grpo.weight_decay", "must be >= 0")
        _check(0 <= self.clip_low < 1, "grpo.clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, "grpo.clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.kl_coef >= 0, "grpo.kl_coef", "must be >= 0")
        _check(self.autocast in ("", "bfloat16"), "grpo.autocast",
               f"must be empty (off) or bfloat16, got {self.autocast!r}")
        _check(self.grad_clip >= 0, "grpo.grad_clip", "must be >= 0")
        _check(self.micro_steps <= self.prompts_per_step * self.group_size, "grpo.micro_steps",
               "must not exceed the rollouts per step (prompts_per_step * group_size)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    #: data-parallel replicas: each generates its share of the step's prompt groups and trains on
    #: them, the policy sharded over the replicas with FSDP2 (dp x pp x cp processes in all)
    dp: int = 1
    #: context-parallel ranks (per pipeline stage): each packed sequence is zigzag-sharded over
    #: them (ring attention); cp x pp processes in all
    cp: int = 1
    #: pipeline-parallel stages (the draft trains on the last one, fed by TapChannel)
    pp: int = 1
    #: pipeline microbatches per GRPO minibatch (whole sequences each)
    microbatches: int = 4
    #: pipeline schedule: 1f1b or gpipe
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        _check(self.dp >= 1, "parallel.dp", f"must be >= 1, got {self.dp}")
        _check(self.cp >= 1, "parallel.cp", f"must be >= 1, got {self.cp}")
        _check(self.pp >= 1, "parallel.pp", f"must be >= 1, got {self.pp}")
        _check(self.microbatches >= 1, "parallel.microbatches", f"must be >= 1, got {self.microbatches}")
        _check(self.schedule in ("1f1b", "gpipe"), "parallel.schedule",
               f"must be 1f1b or gpipe, got {self.schedule!r}")
