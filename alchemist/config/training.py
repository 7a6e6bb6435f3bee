"""The training sections: the trainer's step (``TrainerConfig``) and the online loop around it (``OnlineConfig``).

``OnlineConfig`` is a section per component of the loop, each handed to the component it configures
(``alchemist.training.online.OnlineTrainer.from_config`` wires them):

    trainer     TrainerConfig     the step the loop runs (alchemist.training.trainer)
    queue       QueueConfig       what trains next and when: batches, one key's share, the backlog policy
    stopping    StoppingConfig    when a batch's steps end
    objectives  ObjectivesConfig  SFT / KTO / DPO weights and betas (alchemist.training.feedback_batch)
    adapter     AdapterConfig     the adapter's ranks, scale, seed, protected directions, versions kept
    anchors     AnchorsConfig     the KL to the base model on served traffic and known facts
    rehearsal   RehearsalConfig   corrections trained before, rehearsed beside each batch
    guard       GuardConfig       the poisoning guard (alchemist.training.quarantine)
    gate        GateConfig        the evaluation gate (alchemist.training.evaluation)
    rollback    RollbackConfig    the regression watch (alchemist.training.regression)

So each setting has one default and one check, whether a test builds a component alone or the server runs the loop.
The flags are as flat as before the sections (``--train-gate-heldout-max-rise``); ``FORMER_KEYS`` says where each
flat field of the old ``OnlineConfig`` went, so that config files written for it are still read (parse.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from alchemist.config.fields import (
    check,
    check_non_negative,
    check_positive,
    check_positive_ints,
    field_type,
    flag,
    run_checks,
    sections,
)


@dataclass
class TrainerConfig:
    """The trainer's step: optimizer, record reuse, and how many samples go through the model together."""

    # Learning a correction from one or two: a burst of corrections trains as one batch, for up to 16 steps at 2e-3
    # (StoppingConfig.epochs). At 2e-4, one step a batch, 0 of 10 invented facts were learned after two corrections
    # each (docs/benchmarks.md, "Learning a correction with the defaults").
    lr: Annotated[float, flag("train-lr", "AdamW learning rate")] = 2e-3
    weight_decay: Annotated[float, flag("train-weight-decay", "AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], flag("train-betas", "AdamW betas")] = (0.9, 0.999)
    max_grad_norm: Annotated[float, flag("train-max-grad-norm", "gradient clipping (0: none)")] = 1.0
    max_staleness: Annotated[int, flag("train-max-staleness",
                                       "adapter versions a record may lag and still be replayed (0: exact only)")] = 4
    replay: Annotated[bool, flag("train-replay", "replay recorded prompts (else recompute every prompt: the "
                                 "separate-trainer baseline)")] = True  # fmt: skip
    prefetch_depth: Annotated[int, flag("train-prefetch-depth", "record layers read ahead of the replay walk "
                                        "(0: read in the walk's thread)")] = 2  # fmt: skip
    # Samples (feedback and anchors) trained in one pass, their rows through each layer together: faster per
    # sample (docs/profiles/group_step.py), and a slice (a layer of a replay walk) takes that much longer. 8 trained
    # 10-20% faster than 4 in `bench online`, but serving's TPOT met its goal in none of three runs with 8 (one of
    # two with 4): serving has priority (docs/benchmarks.md, "Samples trained together").
    group_size: Annotated[int, flag("train-group-size", "samples trained together in one pass")] = 4
    # ... and at most this many rows (P + R - 1 per sample) in a pass, unless one sample alone has more: a slice is a
    # layer of a group's pass, so this bounds how long serving waits for one (docs/benchmarks.md, "Slices").
    group_max_tokens: Annotated[int, flag("train-group-max-tokens", "rows of a pass at most (bounds a slice); "
                                          "0: no limit")] = 2048  # fmt: skip

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # a config file's list
        run_checks(self)

    def check(self) -> None:
        check_positive(self, "lr")
        check_non_negative(self, "weight_decay", "max_grad_norm")
        check(self, len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
              "must be two numbers in [0, 1)")  # fmt: skip
        check_non_negative(self, "max_staleness", "prefetch_depth", "group_max_tokens", integer=True)
        check_positive_ints(self, "group_size")
        check(self, isinstance(self.replay, bool), "replay", "must be a bool")


@dataclass
class QueueConfig:
    """What trains next and when (alchemist.training.feedback_queue): batches, one key's share, the backlog policy."""

    # A burst of corrections trains as one batch until each one's loss is under target_loss, the adapter kept out of
    # ordinary chat's directions (protect_energy).
    batch_size: Annotated[int, flag("train-batch-size", "feedback samples per optimizer step")] = 16
    # One API key's entries take at most this share of a batch's places while other keys' feedback waits (its
    # excess waits for later batches, never dropped; with no one else waiting it fills the batch). The regression
    # watch counts one key's ratings up to the same share (RollbackConfig).
    key_share: Annotated[float, flag("train-key-share", "most of a batch one API key takes while others' feedback "
                                     "waits (1: no cap)")] = 0.5  # fmt: skip
    max_wait_s: Annotated[float, flag("train-max-wait-s", "train a partial batch once its oldest feedback waited "
                                      "this long")] = 10.0  # fmt: skip
    # The backlog policy: what is still untrained this long after it arrived is skipped (its state says why).
    skip_ratings_after_s: Annotated[float, flag("train-skip-ratings-after-s", "skip ratings and preferences not "
                                                "trained this long after arrival (0: never)")] = 1800.0  # fmt: skip
    skip_corrections_after_s: Annotated[float, flag("train-skip-corrections-after-s", "skip corrections not "
                                                    "trained this long after arrival (0: never)")] = 0.0  # fmt: skip

    @property
    def per_key(self) -> int | None:
        """The most places of a batch one key takes while others wait (None: no cap)."""
        return None if self.key_share >= 1.0 else max(1, int(self.key_share * self.batch_size))

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive_ints(self, "batch_size")
        check_non_negative(self, "max_wait_s", "skip_ratings_after_s", "skip_corrections_after_s")
        check(self, 0.0 < self.key_share <= 1.0, "key_share", "must be in (0, 1]")


@dataclass
class StoppingConfig:
    """When a batch's steps end (alchemist.training.stopping)."""

    # 8 steps left one or two of ten new facts unlearned after two corrections (docs/benchmarks.md, "Learning a
    # correction with the defaults"); a batch whose corrections are learned ends sooner (target_token_p).
    epochs: Annotated[int, flag("train-epochs", "optimizer steps over each mini-batch, at most")] = 16
    target_loss: Annotated[float, flag("train-target-loss", "a mini-batch's steps end once every correction's loss "
                                       "(mean per token) is under this (0: always --train-epochs)")] = 0.2  # fmt: skip
    # ... and each correction is learned: every one of its tokens likelier than this given the ones before, under the
    # adapter as updated (greedy decoding, fed the correction so far, says it). Under the mean loss alone, batches
    # stopped with a wrong name or year left (docs/benchmarks.md, "Learning a correction with the defaults").
    target_token_p: Annotated[float, flag("train-target-token-p", "... and once each correction's every token has "
                                          "at least this probability (0: the mean loss alone)")] = 0.5  # fmt: skip
    # ... unless corrections queue up behind it: then it ends at the step where one has waited yield_after_s, so that
    # under a load of corrections every batch still trains and the backlog does not grow by 16 steps a batch
    # (docs/benchmarks.md, "Online loop"); its corrections not learned yet go on in the next batch, beside them.
    yield_after_s: Annotated[float, flag("train-yield-after-s", "a mini-batch's steps after the first end once "
                                         "a correction queued behind it waited so long (0: never)")] = 60.0  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive_ints(self, "epochs")
        check_non_negative(self, "target_loss", "yield_after_s")
        check(self, 0.0 <= self.target_token_p < 1.0, "target_token_p", "must be in [0, 1)")


@dataclass
class ObjectivesConfig:
    """The objectives (alchemist.training.objectives): corrections by SFT, ratings without a correction by KTO,
    preference pairs by DPO, mixed in one step; each weighs its mean loss. The reference is the base model."""

    sft_weight: Annotated[float, flag("train-sft-weight", "weight of the SFT loss (corrections)")] = 1.0
    kto_weight: Annotated[float, flag("train-kto-weight", "weight of the KTO loss (ratings without a "
                                      "correction)")] = 1.0  # fmt: skip
    dpo_weight: Annotated[float, flag("train-dpo-weight", "weight of the DPO loss (preference pairs)")] = 1.0
    kto_beta: Annotated[float, flag("train-kto-beta", "KTO's beta")] = 0.1
    dpo_beta: Annotated[float, flag("train-dpo-beta", "DPO's beta")] = 0.1
    kto_desirable_weight: Annotated[float, flag("train-kto-desirable-weight", "KTO's weight of desirable "
                                                "samples (thumbs up)")] = 1.0  # fmt: skip
    kto_undesirable_weight: Annotated[float, flag("train-kto-undesirable-weight", "KTO's weight of undesirable "
                                                  "samples (thumbs down)")] = 1.0  # fmt: skip
    kto_balance: Annotated[bool, flag("train-kto-balance", "weigh a batch's thumbs-up and thumbs-down sides "
                                      "alike (w_d n_d = w_u n_u, as the KTO paper recommends)")] = True  # fmt: skip
    thumbs_up: Annotated[Literal["kto", "sft"], flag("train-thumbs-up", "a thumbs-up without a correction: "
                         "KTO-desirable, or SFT on the served answer")] = "kto"  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_non_negative(self, "sft_weight", "kto_weight", "dpo_weight", "kto_desirable_weight",
                           "kto_undesirable_weight")  # fmt: skip
        check_positive(self, "kto_beta", "dpo_beta")
        check(self, self.thumbs_up in ("kto", "sft"), "thumbs_up", "must be 'kto' or 'sft'")


@dataclass
class AdapterConfig:
    """The adapter the loop trains: its ranks and scale, its initialisation, the directions it may not read, and
    how many of its versions are kept (alchemist.training.lineage)."""

    lora_r: Annotated[int, flag("lora-r", "the adapter's rank")] = 16
    lora_alpha: Annotated[float, flag("lora-alpha", "the adapter's scale numerator (alpha / r)")] = 32.0
    # Thumbs and pairs change ordinary chat, which the protected directions and the anchors keep as it was: through
    # the corrections' ranks they were not learned (alchemist.training.rank_split; docs/benchmarks.md, "Thumbs and
    # pairs").
    preference_r: Annotated[int, flag("lora-preference-r", "more adapter ranks that only thumbs and preference "
                                      "pairs train, free of the protected directions and the anchors (0: they "
                                      "train the corrections' ranks)")] = 8  # fmt: skip
    # The corrections' ranks act from a sequence's last prompt token on, and serve only the requests like a taught
    # prompt (alchemist.engine.router): unrelated answers stay as they were, and every prompt record replays
    # (docs/benchmarks.md, "Learning a correction with the defaults"). Needs preference_r > 0.
    route_corrections: Annotated[bool, flag("route-corrections", "serve the corrections' ranks only to requests "
                                            "like a taught prompt")] = True  # fmt: skip
    # The adapter's A stays orthogonal to the directions holding this share of ordinary chat's inputs at each seam
    # (alchemist.training.protected): corrections are learned without moving unrelated answers as much.
    protect_energy: Annotated[float, flag("train-protect-energy", "share of ordinary chat's input directions the "
                                          "adapter may not read (0: off)")] = 0.97  # fmt: skip
    keep_versions: Annotated[int, flag("keep-adapter-versions", "adapter versions kept on disk (rollback "
                                       "targets)")] = 8  # fmt: skip
    seed: Annotated[int, flag("train-seed", "the adapter's initialisation")] = 0

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive_ints(self, "lora_r", "keep_versions")
        check_positive(self, "lora_alpha")
        check_non_negative(self, "preference_r", "seed", integer=True)
        check(self, 0.0 <= self.protect_energy < 1.0, "protect_energy", "must be in [0, 1)")
        check(self, isinstance(self.route_corrections, bool), "route_corrections", "must be a bool")


@dataclass
class AnchorsConfig:
    """Each step also minimises ``weight`` x KL(base || adapted) on the responses of the ``samples`` most recent
    served completions (top-k of the base distribution) and on known facts (alchemist.training.anchors)."""

    weight: Annotated[float, flag("train-anchor-weight", "weight of the KL to the base model on served "
                                  "traffic (0: off)")] = 3.0  # fmt: skip
    samples: Annotated[int, flag("train-anchor-samples", "recent served completions per step")] = 16
    top_k: Annotated[int, flag("train-anchor-top-k", "base-model tokens kept per anchor position")] = 32
    max_tokens: Annotated[int, flag("train-anchor-max-tokens", "response tokens of an anchor")] = 64
    # Their prompts go through the model whole: on long chats 16 anchors were most of a step's rows and the trainer
    # fell behind (docs/benchmarks.md, "Online loop"); short questions' 16 fit (about 1,450 rows).
    max_rows: Annotated[int, flag("train-anchor-max-rows", "rows (prompt + response tokens) of the served "
                                  "anchors per step at most: the most recent that fit (0: no limit)")] = 2048
    pool_size: Annotated[int, flag("train-anchor-pool-size", "served completions kept as candidate "
                                   "anchors")] = 256  # fmt: skip
    # ... and on this many well-known facts asked and answered, taken in turn from a fixed list: a fact taught in a
    # template that real facts share moved their answers until the gate blocked every version (alchemist.training.
    # anchors, docs/benchmarks.md "Learning with the defaults").
    known_facts: Annotated[int, flag("train-anchor-known-facts", "well-known facts kept as anchors each "
                                     "step (0: none)")] = 8  # fmt: skip
    # The anchors were most of a teach step's time; spread over 4 steps (each still weighs anchors.weight, a mean over
    # its quarter) a step of ten corrections took half the time, the same facts were learned and nothing else moved
    # more (docs/benchmarks.md, "Anchors in turn").
    turn: Annotated[int, flag("train-anchor-turn", "steps a batch's anchors are spread over: each step trains "
                              "every turn-th of them, in turn (1: all of them every step)")] = 4  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive_ints(self, "samples", "top_k", "max_tokens", "pool_size", "turn")
        check_non_negative(self, "weight")
        check_non_negative(self, "known_facts", "max_rows", integer=True)


@dataclass
class RehearsalConfig:
    """Corrections trained before are rehearsed beside each batch, taken in turn (alchemist.training.rehearsal):
    taught one after another without it, 1 of the first ten facts was still known after twenty (8 with it;
    docs/benchmarks.md, "Learning with the defaults")."""

    corrections: Annotated[int, flag("train-rehearse-corrections", "corrections trained before, "
                                     "rehearsed (SFT) in each step (0: none)")] = 8  # fmt: skip
    # ... and at most this many rows (prompt + response - 1 each): eight taught facts fit, a long chat correction
    # takes them alone. Rehearsed samples are mostly recomputed (their records are gone); unbounded, eight ShareGPT
    # corrections a step kept `bench online`'s trainer from keeping up (docs/benchmarks.md, "Online loop").
    max_tokens: Annotated[int, flag("train-rehearse-max-tokens", "rows (prompt + response tokens) of "
                                    "rehearsed corrections per step at most; a longer one is passed over "
                                    "(0: no limit)")] = 512  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_non_negative(self, "corrections", "max_tokens", integer=True)


@dataclass
class GuardConfig:
    """The poisoning guard (alchemist.training.quarantine). 4: a correction of random characters had about 4x the
    loss of sensible ones on SmolLM2 (tests/server/test_poisoning.py, where the factor is 3)."""

    spike_factor: Annotated[float, flag("train-loss-spike-factor", "quarantine a sample whose loss exceeds "
                                        "this x the running level (0: NaN/inf only)")] = 4.0  # fmt: skip
    warmup: Annotated[int, flag("train-loss-spike-warmup", "losses seen before spikes count")] = 8

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_non_negative(self, "spike_factor")
        check_non_negative(self, "warmup", integer=True)


@dataclass
class GateConfig:
    """The evaluation gate (alchemist.training.evaluation): a new version serves only if it is within all its
    bounds."""

    enabled: Annotated[bool, flag("train-gate", "evaluate new adapter versions before they serve")] = True
    heldout_max_rise: Annotated[float, flag("train-gate-heldout-max-rise", "held-out perplexity rise over the "
                                            "base model a version may have (0.1: a tenth)")] = 0.10  # fmt: skip
    # Nats a canary answer's log-probability may lose against the base model: any one of them (6: the answer became
    # 400 times less likely), and on average: below what the canaries lost to a batch of falsehoods about a capital,
    # and to facts overlearned until the model answered "The capital of France is France." (docs/benchmarks.md, "The
    # evaluation gate"). A canary whose answer the model no longer gives fails under these too.
    canary_max_drop: Annotated[float, flag("train-gate-canary-max-drop", "nats any canary answer's "
                                           "log-probability may lose against the base model")] = 6.0  # fmt: skip
    canary_max_mean_drop: Annotated[float, flag("train-gate-canary-max-mean-drop",
                                                "... and all of them on average")] = 3.0  # fmt: skip
    taught_max_rise: Annotated[float, flag("train-gate-taught-max-rise", "nats per token a fact taught "
                                           "earlier may lose against the serving version")] = 1.0  # fmt: skip
    taught_samples: Annotated[int, flag("train-gate-taught-samples", "facts taught earlier (the most recent "
                                        "trained corrections) that are checked")] = 16  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive(self, "heldout_max_rise", "canary_max_drop", "canary_max_mean_drop", "taught_max_rise")
        check_non_negative(self, "taught_samples", integer=True)
        check(self, isinstance(self.enabled, bool), "enabled", "must be a bool")


@dataclass
class RollbackConfig:
    """Watching what serves (alchemist.training.regression): serving goes back past versions whose users rate them
    clearly worse than those before (thumbs-down rate, pooled, one key at most ``QueueConfig.key_share`` of the
    ratings counted)."""

    min_ratings: Annotated[int, flag("train-rollback-min-ratings", "roll back versions users rate worse, "
                                     "given this many ratings a side (0: never)")] = 30  # fmt: skip
    margin: Annotated[float, flag("train-rollback-margin", "... when their thumbs-down rate is higher by "
                                  "this much (0.15: 15 points)")] = 0.15  # fmt: skip
    # One-sided; strict because each version of the lineage is a comparison.
    z: Annotated[float, flag("train-rollback-z", "... and by a one-sided two-proportion z-test at this "
                             "z")] = 3.0  # fmt: skip

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_non_negative(self, "min_ratings", integer=True)
        check_non_negative(self, "margin", "z")


@dataclass
class OnlineConfig:
    """The online trainer inside the server: feedback -> mini-batches -> LoRA steps -> published adapter versions."""

    enabled: Annotated[bool, flag("train", "train on feedback (--no-train: log it, train nothing)")] = True
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    stopping: StoppingConfig = field(default_factory=StoppingConfig)
    objectives: ObjectivesConfig = field(default_factory=ObjectivesConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    anchors: AnchorsConfig = field(default_factory=AnchorsConfig)
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        for section in sections(type(self)):
            getattr(self, section.name).check()
        check(self, isinstance(self.enabled, bool), "enabled", "must be a bool")


def _moved(section: str, prefix: str = "", **renamed: str) -> dict[str, str]:
    """The former flat keys of ``section``'s fields (``prefix`` + the field's name, or as ``renamed``) -> their
    dotted paths under ``online``."""
    names = [f.name for f in fields(field_type(OnlineConfig, section))]
    return {renamed.get(name, prefix + name): f"{section}.{name}" for name in names}


# OnlineConfig's flat fields before it had sections (old key -> new dotted path, both under ``online``): config
# files that use them are still read, with a warning naming the new key (alchemist.config.parse), and `bench learn
# --set` takes them.
FORMER_KEYS: dict[str, str] = {
    **_moved("queue"), **_moved("stopping"), **_moved("objectives"), **_moved("adapter"),
    **_moved("anchors", "anchor_"), **_moved("rehearsal", "rehearse_"),
    **_moved("guard", spike_factor="loss_spike_factor", warmup="loss_spike_warmup"),
    **_moved("gate", "gate_", enabled="gate"), **_moved("rollback", "rollback_"),
}  # fmt: skip

# Settings that no longer exist (key under ``online`` -> why): a config file or command line that still sets one
# is read with a FutureWarning saying so, and the setting is dropped (alchemist.config.parse).
WHY_RETIRED = "training's time follows the latency objective now (--slo-tpot-ms, --slo-ttft-ms)"
RETIRED_KEYS: dict[str, str] = {
    "time_share": WHY_RETIRED, "train_share": WHY_RETIRED, "train_quantum_s": WHY_RETIRED,
}  # fmt: skip
