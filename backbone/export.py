"""``backbone export``: a stored checkpoint's model parameters as a file other tools load.

The output is a safetensors file of the checkpoint's ``model/*`` tensors, named without that prefix (as
the model's own parameter names), with metadata ``format="pt"`` (what the Hugging Face loaders expect of
a PyTorch state dict), ``step``, ``run_id``, ``task`` and ``state_format`` (the checkpoint's format).
Optimizer tensors are left out. The checkpoint is checked against its digest before anything is written,
and the output appears atomically (temporary file, then rename).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import safetensors.numpy

from shared.errors import ConfigError, StateError
from shared.state.blob import decode_state, state_digest

from .checkpoints import CheckpointStore

__all__ = ["MODEL_PREFIX", "export_checkpoint"]

MODEL_PREFIX = "model/"


def export_checkpoint(directory: Path, output: Path, step: int | None = None) -> str:
    """Write the model tensors of the newest checkpoint in ``directory`` (or that of ``step``) to
    ``output``; return a one-line description of what was written.

    Raises:
        ConfigError: there is no such checkpoint, it is damaged, or ``output`` cannot be written.
    """
    store = CheckpointStore(directory, readonly=True)
    entry = store.newest() if step is None else store.at_step(step)
    if entry is None:
        have = ", ".join(str(e.step) for e in store.entries())
        if step is None or not have:
            raise ConfigError(f"no checkpoint in {directory}: the backbone has not stored one yet")
        raise ConfigError(f"no checkpoint of step {step} in {directory} (kept steps: {have})")
    path = store.path(entry.digest)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the checkpoint of step {entry.step}: {exc}") from exc
    if state_digest(blob) != entry.digest:
        raise ConfigError(f"the checkpoint of step {entry.step} ({path}) is damaged: its digest differs")
    try:
        tensors, metadata = decode_state(blob)
    except StateError as exc:
        raise ConfigError(f"the checkpoint of step {entry.step} is not a usable state: {exc}") from exc
    model = {name[len(MODEL_PREFIX) :]: t for name, t in tensors.items() if name.startswith(MODEL_PREFIX)}
    if not model:
        raise ConfigError(f"the checkpoint of step {entry.step} holds no {MODEL_PREFIX}* tensors")
    out_meta = {
        "format": "pt",
        "state_format": metadata["format"],
        "step": metadata["step"],
        "run_id": metadata["run_id"],
        "task": metadata["task"],
    }
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        safetensors.numpy.save_file(model, tmp, metadata=out_meta)
        os.replace(tmp, output)
    except OSError as exc:
        raise ConfigError(f"cannot write {output}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    size = output.stat().st_size
    return (
        f"wrote {output}: {len(model)} tensors of step {metadata['step']} "
        f"(run {metadata['run_id']}, task {metadata['task']}, {size / 1e6:.1f} MB, safetensors)"
    )
