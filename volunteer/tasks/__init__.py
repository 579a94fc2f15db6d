"""The built-in training tasks a run's manifest can name (DESIGN D8: model factory, data pipeline, loss).

Modules:
    base      the :class:`Task` interface and the determinism it promises
    registry  :func:`make_task`: a run's ``training.task`` and ``task_options`` to a task
    tiny_mlm  ``tiny-mlm``: a small transformer masked-LM over the project's synthetic corpus
    hf        ``hf-mlm`` and ``hf-clm``: Hugging Face transformers models built from a config
    stages    a task's model as S consecutive pipeline stages (the SWARM mode's unit of serving)
    plugins   tasks of installed plugins (entry point group ``dedloc.tasks``), never code from the network
"""

from __future__ import annotations

from .base import Batch as Batch
from .base import Task as Task
from .registry import TASKS as TASKS
from .registry import make_task as make_task
from .tiny_mlm import TinyMLM as TinyMLM

__all__ = ["TASKS", "Batch", "Task", "TinyMLM", "make_task"]
