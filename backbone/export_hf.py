"""``backbone export --format hf``: a checkpoint as a Hugging Face model folder, written without torch.

A run of ``hf-mlm`` or ``hf-clm`` trains a ``transformers`` model built from the run's config and
tokenizer (:mod:`shared.tasks`, :mod:`shared.tokenizer`). The folder this writes is what
``save_pretrained`` would have written for that model, so that ``AutoModelForMaskedLM.from_pretrained``
(``AutoModelForCausalLM`` for ``hf-clm``) and ``AutoTokenizer.from_pretrained`` load it directly:

* ``config.json``: :func:`shared.tasks.hf_model_config` of the spec the backbone serves
  (``training.json`` in its data dir) and its tokenizer: the config every volunteer built the model from;
* ``model.safetensors``: the checkpoint's ``model/*`` tensors under the model's own names (a tied weight
  appears under both names, as in the state dict), metadata ``format = "pt"``;
* ``tokenizer.json`` (the run's tokenizer, checked against the SHA-256 the spec pins),
  ``tokenizer_config.json`` and ``special_tokens_map.json``.

The backbone imports no torch and no ``transformers``: config and tokenizer files are JSON, the tensors
are copied from the checkpoint blob by ``safetensors.numpy``. The folder appears atomically (written
beside it, then renamed): a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import safetensors.numpy
from safetensors import SafetensorError

from shared.errors import ConfigError
from shared.tasks import TOKENIZED_TASKS, HFOptions, hf_model_config
from shared.tokenizer import read_tokenizer, tokenizer_json_config

from .export import load_model_tensors
from .runinfo import read_served_spec
from .tokenizer import TOKENIZER_FILE

__all__ = ["export_hf"]


def export_hf(data_dir: Path, checkpoints: Path, output: Path, step: int | None = None) -> str:
    """Write the Hugging Face folder ``output`` (module docstring); return a one-line description.

    Raises:
        ConfigError: the run's task is not a Hugging Face one, the folder exists and is not empty, or
            the checkpoint, the spec or the tokenizer is missing or damaged.
    """
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"--output {output} exists and is not an empty directory; give a new folder")
    if not output.parent.is_dir():
        raise ConfigError(f"cannot write {output}: the directory {output.parent} does not exist")
    spec = read_served_spec(data_dir)
    if spec.task not in TOKENIZED_TASKS:
        raise ConfigError(
            f"the run trains {spec.task}, not a Hugging Face model: export it with --format safetensors"
        )
    model, metadata = load_model_tensors(checkpoints, step)
    if metadata.get("task") != spec.task:
        raise ConfigError(f"the checkpoint is of task {metadata.get('task')!r}, the run's is {spec.task!r}")
    try:
        data = (data_dir / TOKENIZER_FILE).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the run's tokenizer {data_dir / TOKENIZER_FILE}: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != spec.tokenizer.sha256:
        raise ConfigError(f"{data_dir / TOKENIZER_FILE} is not the tokenizer the run's spec pins")
    _, info = read_tokenizer(data)
    options = HFOptions.parse(spec.task, spec.task_options)
    config = {**hf_model_config(options, info.vocab_size, info.special), "dtype": "float32"}
    special_map = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    }
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_json(tmp / "config.json", config)
        safetensors.numpy.save_file(
            model, tmp / "model.safetensors", metadata={"format": "pt", "step": metadata.get("step", "")}
        )
        (tmp / "tokenizer.json").write_bytes(data)
        _write_json(tmp / "tokenizer_config.json", tokenizer_json_config(info, options.seq_len))
        _write_json(tmp / "special_tokens_map.json", special_map)
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.replace(tmp, output)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"cannot write {output}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    head = "AutoModelForMaskedLM" if spec.task == "hf-mlm" else "AutoModelForCausalLM"
    return (
        f"wrote {output}: a {options.model_type} model of step {metadata.get('step')} "
        f"({len(model)} tensors) and the run's tokenizer; load it with "
        f"transformers.{head}.from_pretrained({str(output)!r}) and AutoTokenizer.from_pretrained"
    )


def _write_json(path: Path, value: Mapping[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
