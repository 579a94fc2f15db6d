"""Wire types of held-out evaluation (issue 12 item 7): the dataset table's new fields keep manifests
readable both ways (an old manifest decodes with their defaults; a run that leaves them at their defaults
is read by volunteers of the release before them), and an evaluation decodes only within its bounds."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import pytest

from protocols.errors import ProtocolError
from protocols.evaluation import MAX_EVALUATION_BYTES, Evaluation, decode_evaluation
from protocols.training import DatasetSpec, TrainingSpec
from shared.auth.keys import Identity


class OldDatasetSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """DatasetSpec before issue 12 item 7."""

    source: Literal["backbone", "files", "hub"] = "backbone"
    files: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    hub_id: str = ""
    hub_config: str = ""
    split: str = "train"
    text_field: str = "text"
    shuffle_buffer: int = 10_000
    generate: int = 0
    examples_per_shard: int = 2_000


def test_a_dataset_table_at_the_evaluation_defaults_is_read_by_the_release_before_them() -> None:
    spec = TrainingSpec(dataset=DatasetSpec(generate=2, examples_per_shard=7, shuffle_buffer=50))
    encoded = msgspec.json.encode(spec.dataset)
    assert b"eval_" not in encoded
    assert msgspec.json.decode(encoded, type=OldDatasetSpec) == OldDatasetSpec(
        generate=2, examples_per_shard=7, shuffle_buffer=50
    )
    old = msgspec.json.encode(OldDatasetSpec(generate=3))
    assert msgspec.json.decode(old, type=DatasetSpec) == DatasetSpec(generate=3)  # defaults: 256, 50
    assert (DatasetSpec().eval_examples, DatasetSpec().eval_every, DatasetSpec().eval_files) == (256, 50, [])
    with pytest.raises(msgspec.ValidationError, match="eval_examples"):
        msgspec.json.decode(b'{"eval_examples": 0}', type=DatasetSpec)
    with pytest.raises(msgspec.ValidationError, match="eval_files"):
        msgspec.convert({"eval_files": ["x"] * 65}, DatasetSpec)


def test_an_evaluation_decodes_only_within_its_bounds() -> None:
    value = Evaluation(
        run_id="r@x",
        peer_id=Identity.generate().peer_id,
        step=5,
        params=b"\x01" * 8,
        loss=2.5,
        examples=256,
        eval_set="0" * 64,
        timestamp=1.7e9,
    )
    data = msgspec.msgpack.encode(value)
    assert decode_evaluation(data) == value and len(data) < MAX_EVALUATION_BYTES // 4
    for field, bad in (
        ("step", 0),
        ("examples", 0),
        ("loss", math.inf),
        ("eval_set", "xyz"),
        ("params", b""),
    ):
        raw = msgspec.to_builtins(value)
        raw[field] = bad
        with pytest.raises(ProtocolError):
            decode_evaluation(msgspec.msgpack.encode(raw))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_evaluation(b"\x00" * (MAX_EVALUATION_BYTES + 1))
    with pytest.raises(ProtocolError):
        decode_evaluation(data[:-3])
