"""``backbone export``: a stored checkpoint's model parameters as a file other tools load.

The output is a safetensors file of the checkpoint's ``model/*`` tensors, named without that prefix (as
the model's own parameter names), with metadata ``format="pt"`` (what the Hugging Face loaders expect of
a PyTorch state dict), ``step``, ``run_id``, ``task`` and ``state_format`` (the checkpoint's format).
Optimizer tensors are left out. The output's directory is checked first (it must exist and be writable;
the output must not be a directory), the checkpoint is checked against its digest before anything is
written, and the output appears atomically (temporary file, then rename): a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import safetensors.numpy
from safetensors import SafetensorError

from shared.errors import ConfigError, StateError
from shared.state.blob import decode_state, state_digest

from .checkpoints import CheckpointStore

__all__ = ["MODEL_PREFIX", "export_checkpoint", "load_model_tensors"]

MODEL_PREFIX = "model/"


def load_model_tensors(directory: Path, step: int | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``model/*`` tensors (named without the prefix) and the metadata of the newest checkpoint in
    ``directory``, or of ``step``'s, checked against its digest.

    Raises:
        ConfigError: there is no such checkpoint, or it is damaged.
    """
    if not directory.parent.is_dir():
        raise ConfigError(f"{directory.parent} is not a backbone data dir: give the --data-dir of a backbone")
    store = CheckpointStore(directory, readonly=True)
    entry = store.newest() if step is None else store.at_step(step)
    if entry is None:
        have = ", ".join(str(e.step) for e in store.entries())
        if not have:
            raise ConfigError(
                f"no checkpoint in {directory} yet: a running backbone stores one every checkpoint_every "
                "steps once volunteers train; export again later"
            )
        raise ConfigError(
            f"no checkpoint of step {step} in {directory}: it keeps steps {have}; give one of them"
        )
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
    return model, dict(metadata)


def export_checkpoint(directory: Path, output: Path, step: int | None = None) -> str:
    """Write the model tensors of the newest checkpoint in ``directory`` (or that of ``step``) to
    ``output``; return a one-line description of what was written.

    Raises:
        ConfigError: there is no such checkpoint, it is damaged, or ``output`` cannot be written.
    """
    output = Path(output)
    _check_output(output)
    model, metadata = load_model_tensors(directory, step)
    out_meta = {
        "format": "pt",
        "state_format": metadata["format"],
        "step": metadata["step"],
        "run_id": metadata["run_id"],
        "task": metadata["task"],
    }
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        safetensors.numpy.save_file(model, tmp, metadata=out_meta)
        os.replace(tmp, output)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"cannot write {output}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    size = output.stat().st_size
    return (
        f"wrote {output}: {len(model)} tensors of step {metadata['step']} "
        f"(run {metadata['run_id']}, task {metadata['task']}, {size / 1e6:.1f} MB, safetensors)"
    )


def _check_output(output: Path) -> None:
    """Refuse an output no file can be written to, before any work.

    Raises:
        ConfigError: ``output`` is a directory, or its directory is missing or not writable.
    """
    if output.is_dir():
        raise ConfigError(
            f"--output {output} is a directory; give a file name, e.g. {output / 'model.safetensors'}"
        )
    parent = output.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {output}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {output}: the directory {parent} is not writable by you")
