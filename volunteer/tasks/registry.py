"""Task names to task factories: what a run's ``training.task`` may name.

Every name here is in :data:`shared.tasks.TASK_OPTIONS` (the torch-free catalog backbones check a run's
spec against) with the same options parser, and the other way round: a test checks both. A spec that
names a ``plugin`` gets its task from that installed plugin instead (:mod:`volunteer.tasks.plugins`),
through the same interface: a factory called with the spec and the run's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

from protocols.training import TrainingSpec
from shared.errors import ConfigError

from .base import Task
from .hf import HFCausalLM, HFMaskedLM
from .plugins import plugin_factory
from .tiny_mlm import TinyMLM

__all__ = ["TASKS", "make_task"]

#: task name -> factory(spec, the run's tokenizer.json or None); a run's ``training.task`` is one of these
TASKS: dict[str, Callable[[TrainingSpec, bytes | None], Task]] = {
    TinyMLM.name: TinyMLM,
    HFMaskedLM.name: HFMaskedLM,
    HFCausalLM.name: HFCausalLM,
}


def make_task(spec: TrainingSpec, tokenizer: bytes | None = None) -> Task:
    """The task ``spec.task`` with ``spec.task_options``; ``tokenizer`` is the run's ``tokenizer.json``
    (checked against ``spec.tokenizer.sha256`` by whoever fetched it), for the tasks that tokenize.

    Raises:
        ConfigError: the task is unknown (the message lists the known ones), an option is bad, or a task
            that tokenizes got no tokenizer.
    """
    if spec.plugin:
        if spec.task in TASKS:
            raise ConfigError(f"{spec.task} is a built-in task: remove plugin = {spec.plugin!r}")
        task: Task = plugin_factory(spec.task, spec.plugin)(spec, tokenizer)
        return task
    factory = TASKS.get(spec.task)
    if factory is None:
        raise ConfigError(f"unknown training task {spec.task!r}; known tasks: {', '.join(sorted(TASKS))}")
    return factory(spec, tokenizer)
