"""What a volunteer can train, known without torch: the catalog of task names and their option schemas,
the optimizers, and :func:`check_trainable`, which refuses a training spec no volunteer could train.

A backbone never imports torch (DESIGN/STYLE §5.2), yet it must refuse at ``backbone start`` a run its
volunteers would fail on after admission (``task = "gpt-5"``, a bad ``task_options`` value, an optimizer
they do not have). So the parts of a task that decide whether a spec is usable live here, in plain
Python: each task's options are a frozen dataclass with a ``parse`` that raises :class:`ConfigError`.
The volunteer's registry (:mod:`volunteer.tasks.registry`) builds its tasks from these same option
classes, and a test checks that both know the same task names, so the two cannot drift apart.

Rules :func:`check_trainable` adds to the manifest's field-by-field validation (``protocols.training``):

* the task is in :data:`TASK_OPTIONS` and its ``task_options`` parse;
* the optimizer is one of :data:`OPTIMIZERS` (``lamb`` is named by the wire format but not built);
  ``momentum`` is set only for ``sgd`` (the others would ignore it silently);
* ``local_batch <= target_batch``: one micro-batch must not overshoot the global batch by itself;
* ``schedule.warmup_steps <= schedule.total_steps``;
* a backbone-generated synthetic corpus (``dataset.source = "backbone"``, ``generate > 0``) holds its
  text under ``"text"``, so ``dataset.text_field`` must be ``"text"`` then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocols.training import OptionValue, TrainingSpec

from .errors import ConfigError

__all__ = ["OPTIMIZERS", "TASK_OPTIONS", "TinyMLMOptions", "check_trainable"]

#: The optimizers a volunteer builds (``volunteer.collab.trainer.make_optimizer``).
OPTIMIZERS = ("adamw", "adam", "sgd")
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


#: task name -> the parser of its ``task_options``; a run's ``task`` must be one of these.
TASK_OPTIONS: dict[str, Callable[[Mapping[str, OptionValue]], object]] = {"tiny-mlm": TinyMLMOptions.parse}


def check_trainable(spec: TrainingSpec) -> None:
    """Refuse a spec no volunteer could train (the rules of the module docstring).

    Raises:
        ConfigError: the first rule ``spec`` breaks, saying what to change.
    """
    parse = TASK_OPTIONS.get(spec.task)
    if parse is None:
        raise ConfigError(
            f"unknown task {spec.task!r}: volunteers can train {', '.join(sorted(TASK_OPTIONS))}"
        )
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
    schedule = spec.schedule
    if schedule.warmup_steps > schedule.total_steps:
        raise ConfigError(
            f"schedule.warmup_steps ({schedule.warmup_steps}) exceeds schedule.total_steps "
            f"({schedule.total_steps}); the warm-up must end within the schedule"
        )
    dataset = spec.dataset
    generated = dataset.source == "backbone" and dataset.generate > 0
    if generated and dataset.text_field != GENERATED_TEXT_FIELD:
        raise ConfigError(
            f"dataset.text_field is {dataset.text_field!r}, but the corpus the backbone generates keeps "
            f"its text in {GENERATED_TEXT_FIELD!r}; remove text_field or serve shards of your own"
        )
