"""The training loop's micro-batch cut (issue 11: a step's share is filled exactly, no example lost)."""

from __future__ import annotations

import torch

from volunteer.training import split_batch


def test_a_cut_micro_batch_keeps_the_rest_for_the_next_one() -> None:
    ids, labels = torch.arange(16).reshape(8, 2), torch.arange(8)
    batch = {"input_ids": ids, "labels": labels, "scale": torch.tensor(2.0)}
    head, rest = split_batch(batch, 3)
    assert rest is not None
    assert head["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5]] and head["labels"].tolist() == [0, 1, 2]
    assert rest["labels"].tolist() == [3, 4, 5, 6, 7] and rest["input_ids"].shape == (5, 2)
    assert float(head["scale"]) == float(rest["scale"]) == 2.0  # not batch-first: goes to both
    whole, nothing = split_batch(batch, 8)
    assert whole is batch and nothing is None
