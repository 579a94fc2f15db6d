"""What a volunteer can train, known without torch: the catalog of task names and their option schemas,
the optimizers, and :func:`check_trainable`, which refuses a training spec no volunteer could train.

A backbone never imports torch (DESIGN/STYLE §5.2), yet it must refuse at ``backbone start`` a run its
volunteers would fail on after admission (``task = "gpt-5"``, a bad ``task_options`` value, an optimizer
they do not have). So the parts of a task that decide whether a spec is usable live here, in plain
Python: each task's options are a frozen dataclass with a ``parse`` that raises :class:`ConfigError`.
The volunteer's registry (:mod:`volunteer.tasks.registry`) builds its tasks from these same option
classes, and a test checks that both know the same task names, so the two cannot drift apart.

Rules :func:`check_trainable` adds to the manifest's field-by-field validation (``protocols.training``):

* the task is in :data:`TASK_OPTIONS` and its ``task_options`` parse, or the spec names the ``plugin``
  (``distribution==version``) that brings it: a plugin's options are checked by the volunteers that
  have it installed, not here;
* the optimizer is one of :data:`OPTIMIZERS` (all the wire format names);
  ``momentum`` is set only for ``sgd`` (the others would ignore it silently);
* ``local_batch <= target_batch``: one micro-batch must not overshoot the global batch by itself;
* ``schedule.warmup_steps <= schedule.total_steps``;
* ``[sync] mode = "swarm"`` declares ``stages >= 2`` (and only that mode declares stages), no ``dpu``, and
  for ``tiny-mlm`` at most one stage per layer (the Hugging Face tasks' limits are checked by the
  volunteers, who build the model: ``volunteer.tasks.stages``);
* a task that tokenizes (``hf-mlm``, ``hf-clm``) has a ``[tokenizer]``, and only such a task has one; a
  tokenizer the backbone trains needs the backbone to hold the text (``dataset.source = "backbone"``);
* a backbone-generated synthetic corpus (``dataset.source = "backbone"``, ``generate > 0``) holds its
  text under ``"text"``, so ``dataset.text_field`` must be ``"text"`` then.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocols.training import OptionValue, TrainingSpec

from .errors import ConfigError

__all__ = [
    "HFOptions",
    "OPTIMIZERS",
    "TASK_OPTIONS",
    "TOKENIZED_TASKS",
    "TinyMLMOptions",
    "check_trainable",
    "hf_model_config",
]

#: The optimizers a volunteer builds (``volunteer.collab.trainer.make_optimizer``).
OPTIMIZERS = ("adamw", "adam", "sgd", "lamb")
#: The field of each example of the synthetic corpus a backbone generates (``shared.data.corpus``).
GENERATED_TEXT_FIELD = "text"


@dataclass(frozen=True)
class TinyMLMOptions:
    """The options of the ``tiny-mlm`` task (``volunteer.tasks.tiny_mlm``)."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 48
    ffn: int = 128
    dropout: float = 0.0
    mask_prob: float = 0.15

    @classmethod
    def parse(cls, options: Mapping[str, OptionValue]) -> TinyMLMOptions:
        """Options from a run's ``task_options``, defaults for the missing ones.

        Raises:
            ConfigError: an unknown option, a value of the wrong type, or one out of range.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ConfigError(f"tiny-mlm has no option {', '.join(unknown)}; it knows {', '.join(fields)}")
        values: dict[str, int | float] = {}
        for name, value in options.items():
            wants_int = fields[name].type in (int, "int")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"tiny-mlm option {name} must be a number, got {value!r}")
            if wants_int and not isinstance(value, int):
                raise ConfigError(f"tiny-mlm option {name} must be an integer, got {value!r}")
            values[name] = value if wants_int else float(value)
        parsed = cls(**values)  # type: ignore[arg-type]
        parsed._check()
        return parsed

    def _check(self) -> None:
        limits = {"d_model": 4096, "layers": 64, "heads": 64, "seq_len": 4096, "ffn": 16384}
        for name, most in limits.items():
            value = getattr(self, name)
            if not 1 <= value <= most:
                raise ConfigError(f"tiny-mlm option {name} must be in [1, {most}], got {value}")
        if self.d_model % self.heads:
            raise ConfigError(
                f"tiny-mlm: d_model ({self.d_model}) must be a multiple of heads ({self.heads})"
            )
        if self.seq_len < 2:
            raise ConfigError(f"tiny-mlm option seq_len must be at least 2, got {self.seq_len}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"tiny-mlm option dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"tiny-mlm option mask_prob must be in (0, 1), got {self.mask_prob}")


#: options of a Hugging Face task that are the task's own; every other option is a field of the model's config
HF_TASK_FIELDS = ("model_type", "seq_len", "mask_prob")
#: model config fields the run's tokenizer decides (:func:`hf_model_config`): an organizer may not set them
HF_TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id")
_MODEL_TYPE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class HFOptions:
    """The options of the Hugging Face tasks ``hf-mlm`` and ``hf-clm`` (``volunteer.tasks.hf``).

    ``model_type`` names a ``transformers`` model type (``albert``, ``bert``, ``gpt2``, ``llama``…), built
    from its config class with the run's other options as config fields (``hidden_size = 256``…) and
    randomly initialized from the run's seed: runs train from scratch, never from hub weights. ``seq_len``
    is the length of the packed sequences (tokens); ``mask_prob`` the share of tokens an ``hf-mlm``
    sequence predicts. Whether a config field exists is checked by the volunteer, which has
    ``transformers``; a backbone checks only what it can without it (types, the reserved names).
    """

    task: str
    model_type: str
    seq_len: int = 128
    mask_prob: float = 0.15
    config: tuple[tuple[str, OptionValue], ...] = ()

    @classmethod
    def parse(cls, task: str, options: Mapping[str, OptionValue]) -> HFOptions:
        """Raises ConfigError: no or a malformed ``model_type``, a reserved field, a value out of range."""
        model_type = options.get("model_type")
        if not isinstance(model_type, str) or not _MODEL_TYPE.match(model_type):
            raise ConfigError(
                f"{task} needs task_options.model_type, a transformers model type such as "
                f"{'albert' if task == 'hf-mlm' else 'gpt2'!r}; got {model_type!r}"
            )
        reserved = sorted(set(options) & set(HF_TOKENIZER_FIELDS))
        if reserved:
            raise ConfigError(
                f"{task}: {', '.join(reserved)} {'come' if len(reserved) > 1 else 'comes'} from the run's "
                "tokenizer; remove it from task_options"
            )
        seq_len = options.get("seq_len", cls.seq_len)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 8 <= seq_len <= 65536:
            raise ConfigError(f"{task} option seq_len must be an integer in [8, 65536], got {seq_len!r}")
        mask_prob = options.get("mask_prob", cls.mask_prob)
        if task != "hf-mlm" and "mask_prob" in options:
            raise ConfigError(f"{task} has no option mask_prob (only hf-mlm masks tokens)")
        if isinstance(mask_prob, bool) or not isinstance(mask_prob, int | float) or not 0 < mask_prob < 1:
            raise ConfigError(f"{task} option mask_prob must be in (0, 1), got {mask_prob!r}")
        config = tuple(sorted((k, v) for k, v in options.items() if k not in HF_TASK_FIELDS))
        return cls(task, model_type, seq_len, float(mask_prob), config)


def _hf_parser(task: str) -> Callable[[Mapping[str, OptionValue]], object]:
    return lambda options: HFOptions.parse(task, options)


def hf_model_config(options: HFOptions, vocab_size: int, special: Mapping[str, int]) -> dict[str, object]:
    """The model's config as ``config.json`` holds it: the run's config fields, then what the run's
    tokenizer decides (its vocabulary size and special token ids: ``special`` maps ``[PAD]``,
    ``[CLS]``, ``[SEP]``… to ids). The volunteer builds its model from exactly this and the backbone's
    Hugging Face export writes exactly this, so the exported folder loads the trained tensors."""
    config: dict[str, object] = {"model_type": options.model_type, **dict(options.config)}
    config.update(
        vocab_size=vocab_size,
        pad_token_id=special["[PAD]"],
        bos_token_id=special["[CLS]"],
        eos_token_id=special["[SEP]"],
    )
    return config


#: task name -> the parser of its ``task_options``; a run's ``task`` must be one of these.
TASK_OPTIONS: dict[str, Callable[[Mapping[str, OptionValue]], object]] = {
    "tiny-mlm": TinyMLMOptions.parse,
    "hf-mlm": _hf_parser("hf-mlm"),
    "hf-clm": _hf_parser("hf-clm"),
}
#: tasks that tokenize with the run's tokenizer (``[tokenizer]`` must not be ``none``)
TOKENIZED_TASKS = ("hf-mlm", "hf-clm")


def check_trainable(spec: TrainingSpec) -> None:
    """Refuse a spec no volunteer could train (the rules of the module docstring).

    Raises:
        ConfigError: the first rule ``spec`` breaks, saying what to change.
    """
    parse = TASK_OPTIONS.get(spec.task)
    if parse is not None and spec.plugin:
        raise ConfigError(f"{spec.task} is a built-in task: remove plugin = {spec.plugin!r}")
    if parse is None and not spec.plugin:
        raise ConfigError(
            f"unknown task {spec.task!r}: volunteers can train {', '.join(sorted(TASK_OPTIONS))}, or the "
            'task of a plugin the manifest names (plugin = "distribution==version")'
        )
    if parse is not None:  # a plugin's options are the plugin's to check, on the volunteers
        parse(spec.task_options)
    optimizer = spec.optimizer
    if optimizer.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer {optimizer.name!r} is not available to volunteers: use one of {', '.join(OPTIMIZERS)}"
        )
    if optimizer.momentum and optimizer.name != "sgd":
        raise ConfigError('optimizer.momentum applies to sgd only; remove it or use name = "sgd"')
    if spec.local_batch > spec.target_batch:
        raise ConfigError(
            f"local_batch ({spec.local_batch}) is larger than target_batch ({spec.target_batch}): "
            "one volunteer's micro-batch would overshoot the global batch; lower local_batch"
        )
    if spec.sync.mode == "diloco" and spec.dpu:
        raise ConfigError(
            'dpu (delayed parameter updates) is a batch-mode option; in [sync] mode = "diloco" remove it '
            "(the inner steps already overlap nothing with averaging)"
        )
    _check_swarm(spec)
    if spec.sync.overlap and spec.sync.mode != "diloco":
        raise ConfigError('[sync] overlap is of mode = "diloco"; the batch mode overlaps with dpu = true')
    if spec.sync.min_round and spec.sync.mode != "diloco":
        raise ConfigError('[sync] min_round plans the rounds of mode = "diloco"; remove it in the batch mode')
    if spec.sync.min_round > spec.target_batch:
        raise ConfigError(
            f"[sync] min_round ({spec.sync.min_round}) is larger than target_batch ({spec.target_batch}), "
            "the longest round: lower min_round or raise target_batch"
        )
    schedule = spec.schedule
    if schedule.warmup_steps > schedule.total_steps:
        raise ConfigError(
            f"schedule.warmup_steps ({schedule.warmup_steps}) exceeds schedule.total_steps "
            f"({schedule.total_steps}); the warm-up must end within the schedule"
        )
    dataset = spec.dataset
    _check_tokenizer(spec)
    generated = dataset.source == "backbone" and dataset.generate > 0
    if generated and dataset.text_field != GENERATED_TEXT_FIELD:
        raise ConfigError(
            f"dataset.text_field is {dataset.text_field!r}, but the corpus the backbone generates keeps "
            f"its text in {GENERATED_TEXT_FIELD!r}; remove text_field or serve shards of your own"
        )


def _check_swarm(spec: TrainingSpec) -> None:
    """The swarm mode's rules (module docstring)."""
    sync = spec.sync
    if sync.mode != "swarm":
        if sync.stages:
            raise ConfigError('[sync] stages splits the model of mode = "swarm"; remove it in this mode')
        return
    if sync.stages < 2:
        raise ConfigError(
            f'[sync] mode = "swarm" needs stages = 2 or more (got {sync.stages}): the model is split into '
            "that many consecutive stages, each served by its own volunteers"
        )
    if spec.dpu:
        raise ConfigError(
            'dpu (delayed parameter updates) is a batch-mode option; remove it in mode = "swarm"'
        )
    if spec.task == "tiny-mlm":
        layers = TinyMLMOptions.parse(spec.task_options).layers
        if sync.stages > layers:
            raise ConfigError(
                f"tiny-mlm with {layers} layers splits into at most {layers} stages (got stages = "
                f"{sync.stages}): raise task_options.layers or lower [sync] stages"
            )


def _check_tokenizer(spec: TrainingSpec) -> None:
    kind = spec.tokenizer.kind
    if spec.task in TOKENIZED_TASKS and kind == "none":
        raise ConfigError(
            f"{spec.task} tokenizes text with the run's tokenizer: add a [tokenizer] table, e.g. "
            'kind = "unigram" (the backbone trains one on the run\'s shards) or kind = "file"'
        )
    if spec.task not in TOKENIZED_TASKS and kind != "none":
        raise ConfigError(f"{spec.task} has a vocabulary of its own: remove the [tokenizer] table")
    if kind in ("unigram", "wordpiece", "bpe") and spec.dataset.source != "backbone":
        raise ConfigError(
            f"the backbone trains a {kind} tokenizer on the shards it serves, but dataset.source is "
            f'{spec.dataset.source!r}: ship a tokenizer.json instead (kind = "file", file = "…")'
        )
