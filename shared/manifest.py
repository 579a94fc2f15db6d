"""Reading a run's training spec from a manifest file (TOML or JSON), with errors that say what is wrong.

A manifest file holds the fields of :class:`protocols.training.TrainingSpec` at its top level, or under a
``[training]`` table (then the file may carry other tables, which are ignored, except ``[sync]``, which is
read beside it)::

    task = "tiny-mlm"
    target_batch = 256
    max_steps = 200
    [optimizer]
    lr = 0.003
    [dataset]
    source = "backbone"
    generate = 8
    [sync]
    mode = "batch"         # or "diloco": local inner steps, pseudo-gradients averaged per round;
                           # or "swarm": the model in `stages` pipeline stages served by volunteers

Beyond each field's own bounds, a spec is refused unless every volunteer could train it
(:func:`shared.tasks.check_trainable`: a known task with valid options, an optimizer volunteers have, a local
batch within the target batch…), so ``backbone start`` fails at once instead of every volunteer after
admission.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from protocols.training import TrainingSpec

from .errors import ConfigError
from .tasks import check_trainable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["load_training_spec", "parse_training_spec"]

MAX_MANIFEST_BYTES = 1 << 20


def parse_training_spec(data: bytes, name: str = "manifest") -> TrainingSpec:
    """Raises ConfigError naming the file and the offending field, or the rule of
    :func:`~shared.tasks.check_trainable` the spec breaks."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{name} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name} is not UTF-8 text") from exc
    raw: Any
    try:
        raw = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{name} is neither valid TOML nor JSON: {exc}") from exc
    if isinstance(raw, dict) and isinstance(raw.get("training"), dict):
        # [sync] is the run's, not only training's: read beside a [training] table too
        sync = raw.get("sync")
        raw = raw["training"]
        if sync is not None:
            if "sync" in raw:
                raise ConfigError(f"{name}: [sync] is given twice, at the top level and under [training]")
            raw = {**raw, "sync": sync}
    try:
        spec = msgspec.convert(raw, TrainingSpec)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ConfigError(f"{name}: {exc}") from exc
    try:
        check_trainable(spec)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from exc
    return spec


def load_training_spec(path: Path) -> TrainingSpec:
    """The spec in ``path``; a relative ``tokenizer.file`` is taken relative to the manifest's directory.

    Raises ConfigError if the file is missing, unreadable or not a valid training spec."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_MANIFEST_BYTES + 1)  # no more: the path may be /dev/zero
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {path}: {exc.strerror}") from exc
    spec = parse_training_spec(data, str(path))
    tokenizer = spec.tokenizer
    if tokenizer.file and not Path(tokenizer.file).expanduser().is_absolute():  # relative to the manifest
        located = str(path.parent / Path(tokenizer.file))
        spec = msgspec.structs.replace(spec, tokenizer=msgspec.structs.replace(tokenizer, file=located))
    return spec
