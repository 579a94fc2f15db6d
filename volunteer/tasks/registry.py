"""Task names to task factories: what a run's ``training.task`` may name.

Every name here is in :data:`shared.tasks.TASK_OPTIONS` (the torch-free catalog backbones check a run's
spec against) with the same options parser, and the other way round: a test checks both.
"""

from __future__ import annotations

from collections.abc import Callable

from protocols.training import TrainingSpec
from shared.errors import ConfigError

from .base import Task
from .tiny_mlm import TinyMLM

__all__ = ["TASKS", "make_task"]

#: task name -> factory; a run's ``training.task`` must be one of these
TASKS: dict[str, Callable[[TrainingSpec], Task]] = {TinyMLM.name: TinyMLM}


def make_task(spec: TrainingSpec) -> Task:
    """The task ``spec.task`` with ``spec.task_options``.

    Raises:
        ConfigError: the task is unknown (the message lists the known ones) or an option is bad.
    """
    factory = TASKS.get(spec.task)
    if factory is None:
        raise ConfigError(f"unknown training task {spec.task!r}; known tasks: {', '.join(sorted(TASKS))}")
    return factory(spec)
