"""The run's tokenizer on a volunteer: fetched once by its SHA-256, checked, and kept in the data dir.

A training spec whose task tokenizes pins the run's tokenizer (``training.tokenizer.sha256``, filled in
by the backbone that serves the run; :mod:`shared.tokenizer`). :func:`obtain_tokenizer` returns its bytes:

1. from ``<data dir>/tokenizers/<sha256>.json`` if a earlier join kept it and it still hashes right (a
   damaged copy is removed and fetched again);
2. else from the organizer's ``file`` when the volunteer runs from a local manifest (``--manifest``);
3. else from the backbone API (``GET tokenizer/<sha256>``), then kept.

Bytes that hash to anything but the pinned value are refused, whoever sent them: a peer with another
tokenizer would train other embedding rows and poison every round it joins.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import trio

from protocols.training import TokenizerSpec
from shared.errors import ConfigError
from shared.tokenizer import MAX_TOKENIZER_BYTES

from .api_client import ApiClient

__all__ = ["TOKENIZERS_DIR", "obtain_tokenizer"]

logger = logging.getLogger(__name__)
TOKENIZERS_DIR = "tokenizers"


async def obtain_tokenizer(spec: TokenizerSpec, client: ApiClient | None, data_dir: Path) -> bytes | None:
    """The run's ``tokenizer.json`` (None when its task has no tokenizer). See the module docstring.

    Raises:
        ConfigError: the spec pins no tokenizer, a local file is not the pinned one, or there is no API
            to fetch it from.
        PeerUnavailable: no backbone answered.
        ProtocolError: a backbone sent bytes that are not the pinned tokenizer.
    """
    if spec.kind == "none":
        return None
    if not spec.sha256:
        if spec.file:  # a local manifest that pins nothing: the organizer's file is the tokenizer
            return await trio.to_thread.run_sync(_read, Path(spec.file))
        raise ConfigError(
            "the run's training spec pins no tokenizer (tokenizer.sha256 is empty): its backbone is older "
            "than this volunteer, or the manifest names no tokenizer file"
        )
    cached = data_dir / TOKENIZERS_DIR / f"{spec.sha256}.json"
    data = await trio.to_thread.run_sync(_cached, cached, spec.sha256)
    if data is not None:
        return data
    if spec.file:
        data = await trio.to_thread.run_sync(_read, Path(spec.file))
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.sha256:
            raise ConfigError(
                f"the tokenizer {spec.file} is not the run's: its SHA-256 is {digest[:12]}…, the run pins "
                f"{spec.sha256[:12]}…"
            )
    elif client is None:
        raise ConfigError("the run's tokenizer is fetched from its backbone API, and this run has none")
    else:
        logger.info("fetching the run's tokenizer %s… from the backbone", spec.sha256[:12])
        data = await client.fetch_tokenizer(spec.sha256)
    await trio.to_thread.run_sync(_keep, cached, data)
    return data


def _read(path: Path) -> bytes:
    try:
        with path.expanduser().open("rb") as file:
            data = file.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the tokenizer {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_TOKENIZER_BYTES:
        raise ConfigError(f"the tokenizer {path} is larger than {MAX_TOKENIZER_BYTES} bytes")
    return data


def _cached(path: Path, sha256: str) -> bytes | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if hashlib.sha256(data).hexdigest() == sha256:
        return data
    logger.warning("the kept tokenizer %s is damaged (its SHA-256 differs); fetching it again", path)
    path.unlink(missing_ok=True)
    return None


def _keep(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
