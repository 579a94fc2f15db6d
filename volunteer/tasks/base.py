"""What a training task is to the rest of the volunteer: a model factory, a collate function and a loss.

The collaborative step relies on three properties of every task, which its tests check:

* :meth:`Task.build_model` is deterministic: the same :class:`~protocols.training.TrainingSpec` gives
  bit-identical initial parameters in any process (a local generator, never the global RNG);
* :meth:`Task.preprocess` turns the example stream into samples in the prefetch thread (tokenizing and
  packing text happens there, never on the trio thread);
* :meth:`Task.collate` is a function of the samples alone (random choices such as masking are seeded by
  each example's content), so a batch does not depend on the process or on how samples were split;
* :meth:`Task.loss` is the mean over the batch's *samples*, so the gradient of a batch of ``2b`` samples
  is the average of the gradients of its two halves of ``b`` (up to float rounding): that is what makes
  collaborative training equal to large-batch training (DESIGN §1).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Batch", "Task"]

Batch = dict[str, torch.Tensor]


class Task(Protocol):
    """A built-in training task (see :func:`volunteer.tasks.make_task`)."""

    name: str

    def build_model(self) -> torch.nn.Module:
        """A fresh model with the run's initial parameters (deterministic, see the module docstring)."""
        ...

    def preprocess(self, examples: Iterator[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        """The samples of a stream of dataset examples (lazy; runs in the prefetch thread, blocking): the
        examples themselves, or e.g. packed blocks of token ids (``hf-mlm``)."""
        ...

    def gradient_checkpointing(self, model: torch.nn.Module, enabled: bool) -> None:
        """Turn activation checkpointing on ``model`` on or off.

        Raises:
            ConfigError: the task's model cannot checkpoint activations.
        """
        ...

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> Batch:
        """Tensors of one batch from dataset examples (deterministic, see the module docstring).

        Raises:
            ValueError: ``examples`` is empty or an example lacks the text field.
        """
        ...

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The scalar mean loss over the batch's samples."""
        ...

    def batch_size(self, batch: Mapping[str, torch.Tensor]) -> int:
        """How many samples ``batch`` holds."""
        ...
