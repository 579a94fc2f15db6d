"""What a run trains and how peers tell each other where they are (DESIGN §1, D6, D8; seed 000 §3.1).

**The training spec** (:class:`TrainingSpec`) is the part of the run manifest that says *what* is trained:
the task (a built-in name such as ``tiny-mlm``, or a plugin's with the ``plugin`` it needs, plus its
options), the global target batch, the optimizer and the learning-rate schedule as a function of the
global step, the dataset source, the gradient codec, delayed parameter updates on/off, the averaging rule
(:class:`AveragingSpec`, the ``[averaging]`` table: plain weighted mean, CenteredClip or coordinate-wise
trimmed mean, and the factor of the norm bound; the math is in :mod:`shared.averaging.robust`), the
run's tokenizer (:class:`TokenizerSpec`, the ``[tokenizer]`` table:
trained by the backbone or shipped, pinned by its SHA-256), and the run's step limit.
``backbone start --manifest FILE`` serves it inside :class:`protocols.api.Manifest`; every volunteer of a
run trains exactly this.

**Progress records** (DHT): key :data:`PROGRESS_KEY`, subkey = the writer's peer id, value = msgpack
:class:`Progress`, written only by that peer (subkey-owner validation), expiring after
:data:`PROGRESS_TTL`. A peer re-publishes whenever its numbers change noticeably and at least every
:data:`PROGRESS_PERIOD` seconds. ``step`` is how many optimizer steps its parameters have taken; ``samples``
how many samples it has accumulated toward step ``step + 1``. When the samples of the peers at the
collaboration's step reach ``target_batch``, those peers average and step (see
:mod:`volunteer.collab.progress`).

**Checkpoint records** (DHT): key :data:`CHECKPOINT_KEY`, subkey = the writer's peer id, value = msgpack
:class:`StateAnnouncement`: "I can serve the state of step ``step``, ``nbytes`` long, whose SHA-256 is
``digest``". Volunteers announce the state they hold; backbones announce their newest stored checkpoint.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from .averaging import CodecName
from .types import Bytes32

__all__ = [
    "AVERAGING_PREFIX",
    "CHECKPOINT_KEY",
    "PROGRESS_KEY",
    "PROGRESS_PERIOD",
    "PROGRESS_TTL",
    "TRAINING_KEYS",
    "AggregationRule",
    "AveragingSpec",
    "DatasetSpec",
    "OptimizerSpec",
    "Progress",
    "ScheduleSpec",
    "StateAnnouncement",
    "SyncMode",
    "SyncSpec",
    "TokenizerSpec",
    "TrainingKeys",
    "TrainingSpec",
]

PROGRESS_KEY = "train.progress"
CHECKPOINT_KEY = "train.state"
AVERAGING_PREFIX = "train.avg"


class TrainingKeys(msgspec.Struct, frozen=True):
    """The DHT keys one collaboration's peers meet under: progress records, state announcements and the
    averaging rounds' matchmaking (``<averaging>.<step>.<group>``). The run's data-parallel collaboration
    uses the ``train.*`` keys; each pipeline stage of a swarm run is a collaboration of its own, under
    :func:`protocols.swarm.stage_training_keys`."""

    progress: str = PROGRESS_KEY
    state: str = CHECKPOINT_KEY
    averaging: str = AVERAGING_PREFIX


TRAINING_KEYS = TrainingKeys()
PROGRESS_TTL = 30.0
PROGRESS_PERIOD = 1.0

_MAX_STEP = 2**40
_MAX_SAMPLES = 2**40
Step = Annotated[int, msgspec.Meta(ge=0, le=_MAX_STEP)]
Samples = Annotated[int, msgspec.Meta(ge=0, le=_MAX_SAMPLES)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=1e6)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
#: ``distribution==version`` (PEP 508 names, PEP 440 versions), or empty
PLUGIN_REQUIREMENT = r"^([A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*)?$"
OptionValue = int | float | str | bool


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


class OptimizerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The optimizer every peer applies to the averaged gradient (``lr`` is the schedule's peak)."""

    name: Literal["adamw", "adam", "sgd", "lamb"] = "adamw"
    lr: PositiveFloat = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0, le=1.0)] = 0.0
    momentum: Annotated[float, msgspec.Meta(ge=0, lt=1.0)] = 0.0  # sgd only
    clip_grad_norm: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0  # 0: no clipping

    def __post_init__(self) -> None:
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must be in [0, 1), got {self.betas}")


class ScheduleSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Learning rate as a function of the global step: linear warm-up, then constant, linear or cosine
    decay to ``final_fraction`` times the peak at ``total_steps``."""

    kind: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: Step = 0
    total_steps: Annotated[int, msgspec.Meta(ge=1, le=_MAX_STEP)] = 1000
    final_fraction: Annotated[float, msgspec.Meta(ge=0, le=1.0)] = 0.0

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rate for the optimizer step that takes ``step`` to ``step + 1``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.final_fraction + (1.0 - self.final_fraction) * decay


class DatasetSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where examples come from (DESIGN D6). Every peer streams them in its own random shard order through
    a shuffle buffer of ``shuffle_buffer`` examples.

    * ``backbone``: JSON-lines shards served over HTTPS by the run's backbones (``files`` restricts the
      names; empty = all). With ``generate`` set, a backbone that has no shards writes that many shards of
      the project's synthetic corpus first.
    * ``files``: local paths or globs on each volunteer's machine (JSON lines or text).
    * ``hub``: a dataset id of a dataset hub, streamed (``hub_config``, ``split``).

    Held-out evaluation (:mod:`protocols.evaluation`): the loss over the first ``eval_examples`` examples
    of the held-out files, every ``eval_every`` steps, by volunteers that run ``--evaluate``. For
    ``backbone``, the held-out shards are those the backbones serve under ``heldout`` (``eval_files``:
    name patterns restricting them; ``generate`` writes one); for ``files`` and ``hub``, ``eval_files``
    are local paths or globs on each evaluator's machine.
    """

    source: Literal["backbone", "files", "hub"] = "backbone"
    files: Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=4096)] = []
    hub_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    hub_config: Annotated[str, msgspec.Meta(max_length=128)] = ""
    split: Annotated[str, msgspec.Meta(max_length=64)] = "train"
    text_field: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "text"
    shuffle_buffer: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 10_000
    generate: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0  # shards of synthetic corpus (backbone)
    examples_per_shard: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 2_000
    eval_files: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=64)
    ] = []
    eval_examples: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 256  # held-out examples evaluated
    eval_every: Annotated[int, msgspec.Meta(ge=1, le=_MAX_STEP)] = 50  # steps between evaluations

    def __post_init__(self) -> None:
        if self.source == "files" and not self.files:
            raise ValueError("dataset source 'files' needs at least one path or glob in 'files'")
        if self.source == "hub" and not self.hub_id:
            raise ValueError("dataset source 'hub' needs 'hub_id'")


TokenizerKind = Literal["none", "unigram", "wordpiece", "bpe", "file"]
SHA256_HEX = r"^([0-9a-f]{64})?$"


class TokenizerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The run's tokenizer (the ``[tokenizer]`` table): part of the run, like its parameters.

    * ``none``: the task brings its own vocabulary (``tiny-mlm``);
    * ``unigram`` / ``wordpiece`` / ``bpe``: the first backbone trains one with the ``tokenizers`` library
      on the run's shards at its first start (``vocab_size`` tokens, at most ``train_examples`` examples,
      NFKC-normalized, lower-cased if ``lowercase``) and keeps it in its data dir;
    * ``file``: the organizer ships a ``tokenizer.json`` (``file``, relative to the manifest).

    ``sha256`` pins it: the backbone that serves the run fills it in (and refuses to start if a pinned
    value in the manifest differs from the tokenizer it has); volunteers fetch the tokenizer by this hash
    from the backbone API and refuse bytes that do not hash to it.
    """

    kind: TokenizerKind = "none"
    file: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    vocab_size: Annotated[int, msgspec.Meta(ge=64, le=1 << 20)] = 8000
    lowercase: bool = True
    train_examples: Annotated[int, msgspec.Meta(ge=100, le=100_000_000)] = 200_000
    sha256: Annotated[str, msgspec.Meta(pattern=SHA256_HEX)] = ""

    def __post_init__(self) -> None:
        if self.kind == "file" and not self.file and not self.sha256:
            raise ValueError("tokenizer kind 'file' needs 'file' (a tokenizer.json) or a pinned 'sha256'")


AggregationRule = Literal["mean", "centered-clip", "trimmed-mean"]


class AveragingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an aggregator combines the parts of one slice (math: :mod:`shared.averaging.robust`).

    * ``rule``: ``mean`` (weighted mean), ``centered-clip`` (CenteredClip, BTARD) or ``trimmed-mean``
      (coordinate-wise, ``trim_fraction`` of the senders dropped at each end, at most ``(n - 1) // 2``).
    * ``norm_factor`` (k): a part whose L2 norm exceeds k times the group's (lower) median part norm,
      widened by ``sqrt(median weight / weight)`` for senders of small batches, is rejected and its sender
      banned for the round. Always on; ``inf`` is not accepted.
    * ``clip_factor`` (c): CenteredClip's radius is c times the median distance to the coordinate median;
      ``clip_iterations`` caps its fixed-point iterations.
    """

    rule: AggregationRule = "mean"
    norm_factor: Annotated[float, msgspec.Meta(ge=2.0, le=1e6)] = 10.0
    clip_factor: Annotated[float, msgspec.Meta(ge=0.5, le=1e6)] = 1.0
    clip_iterations: Annotated[int, msgspec.Meta(ge=1, le=100)] = 20
    trim_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=0.5)] = 0.25


#: the most pipeline stages a swarm run may declare (a stage per transformer block of a large model)
MAX_STAGES = 64

SyncMode = Literal["batch", "diloco", "swarm"]


class SyncSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How the peers synchronize (the ``[sync]`` table).

    * ``mode``: ``batch`` (DeDLOC: average the gradients of every global batch of ``target_batch``
      samples and take one optimizer step together) or ``diloco`` (each peer takes inner optimizer steps
      of ``local_batch`` samples at its own pace; when the collaboration has processed ``target_batch``
      samples -- one *round*, one global step -- the peers average their pseudo-gradients weighted by
      their samples and apply the outer optimizer; :mod:`volunteer.collab.diloco`).
    * ``outer_lr``, ``outer_momentum``: the outer optimizer, SGD with Nesterov momentum (DiLoCo: 0.7, 0.9;
      diloco mode only).
    * ``min_round``: 0 (the default) fixes every round at ``target_batch`` samples; above 0 (diloco mode),
      the round length is planned from the members' measured throughput and the plan's predicted averaging
      time, between ``min_round`` and ``target_batch`` samples, so that averaging takes at most
      ``round_fraction`` of a round's compute (:mod:`shared.averaging.round_length`).
    * ``overlap``: diloco mode; the next inner phase starts while the round's averaging runs (one round of
      staleness; the update rule is in :mod:`volunteer.collab.diloco`, "Overlap"): ``true`` or ``"eager"``
      starts it from the outer step taken with the peer's own pseudo-gradient, ``"shift"`` (the earlier
      rule, kept for comparison) from the newest global parameters minus it. The rule is local: ``θ`` and
      the outer momentum are the same on every peer whichever rule each one follows.
    * ``swarm`` mode (:mod:`volunteer.swarm`): the model is split into ``stages`` consecutive stages;
      volunteers serve stages (each stage a batch-mode collaboration of its servers, stepping every
      ``target_batch`` samples) and run trainers that carry micro-batches of ``local_batch`` samples
      through one server per stage; every ``rebalance_period`` seconds the servers move from the least
      to the most loaded stage (:mod:`shared.swarm.rebalance`). ``stages`` is 0 outside this mode.
      ``formation_window`` above 0: the servers that start within that many seconds of the first measure
      their links and are placed by the heterogeneous scheduler (:mod:`volunteer.swarm.formation`); 0
      (the default) places every server as a newcomer.
    """

    mode: SyncMode = "batch"
    outer_lr: Annotated[float, msgspec.Meta(gt=0, le=10.0)] = 0.7
    outer_momentum: Annotated[float, msgspec.Meta(ge=0, lt=1.0)] = 0.9
    min_round: Annotated[int, msgspec.Meta(ge=0, le=2**30)] = 0
    round_fraction: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.05
    overlap: bool | Literal["eager", "shift"] = False
    stages: Annotated[int, msgspec.Meta(ge=0, le=MAX_STAGES)] = 0
    rebalance_period: Annotated[float, msgspec.Meta(ge=1.0, le=3600.0)] = 30.0
    formation_window: Annotated[float, msgspec.Meta(ge=0.0, le=600.0)] = 0.0


class TrainingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What the run trains: see the module docstring. Fields left at their defaults are not encoded, so a
    run that uses none of a newer release's fields is still read by volunteers of the older one."""

    task: Name = "tiny-mlm"
    #: a task of an installed plugin: the distribution and exact version it comes from, ``name==version``
    #: (``""`` for the built-in tasks); see :mod:`volunteer.tasks.plugins`
    plugin: Annotated[str, msgspec.Meta(max_length=200, pattern=PLUGIN_REQUIREMENT)] = ""
    task_options: Annotated[dict[Name, OptionValue], msgspec.Meta(max_length=64)] = {}
    target_batch: Annotated[int, msgspec.Meta(ge=1, le=2**30)] = 256
    local_batch: Annotated[int, msgspec.Meta(ge=1, le=2**20)] = 16  # samples per forward/backward
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    dataset: DatasetSpec = DatasetSpec(generate=8)
    codec: CodecName = "none"
    averaging: AveragingSpec = AveragingSpec()
    tokenizer: TokenizerSpec = TokenizerSpec()
    dpu: bool = False  # delayed parameter updates: overlap the next compute with averaging
    max_steps: Annotated[int, msgspec.Meta(ge=0, le=_MAX_STEP)] = 0  # 0: no limit
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0  # initial parameters
    checkpoint_every: Annotated[int, msgspec.Meta(ge=1, le=_MAX_STEP)] = 10  # steps, backbones
    keep_checkpoints: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    #: activation checkpointing: recompute activations in backward to fit bigger micro-batches (tasks that
    #: expose ``gradient_checkpointing(enabled)``; same gradients, less memory, more compute)
    gradient_checkpointing: bool = False
    sync: SyncSpec = SyncSpec()

    def __post_init__(self) -> None:
        for key, value in self.task_options.items():
            if isinstance(value, float):
                _finite(f"task option {key}", value)
            if isinstance(value, str) and len(value) > 256:
                raise ValueError(f"task option {key} is longer than 256 characters")


class Progress(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One peer's training progress (see the module docstring)."""

    step: Step
    samples: Samples  # accumulated toward step + 1
    samples_per_second: Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    time: float  # unix time of this snapshot
    loss: float | None = None  # mean local loss of the micro-batches toward step + 1
    params: Annotated[bytes, msgspec.Meta(max_length=16)] = b""  # fingerprint of the parameters at step
    ready: bool = False  # it has entered averaging for step -> step + 1
    syncing: bool = False  # it is downloading the state (peers at the collaboration's step announce theirs)
    client_mode: bool = False
    left: bool = False  # its last word: it left the run (peers stop counting it at once)
    #: the global batch of the step that took it to ``step``: its group's total weight (its own samples for
    #: a lone step); 0 if unknown (a loaded state, step 0). What the backbones record as the step's samples.
    batch: Samples = 0
    #: the samples of the round toward ``step + 1`` as this peer planned it (diloco rounds whose length is
    #: planned, :mod:`shared.averaging.round_length`); 0 otherwise
    target: Samples = 0

    def __post_init__(self) -> None:
        _finite("time", self.time)
        _finite("samples_per_second", self.samples_per_second)
        if self.loss is not None and not math.isfinite(self.loss):
            object.__setattr__(self, "loss", None)


class StateAnnouncement(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A peer can serve the training state of ``step``: ``nbytes`` bytes whose SHA-256 is ``digest``."""

    step: Step
    digest: Bytes32
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    time: float
    backbone: bool = False

    def __post_init__(self) -> None:
        _finite("time", self.time)
