"""``run.json`` in a backbone's data dir: what ``backbone allow`` needs to mint invites while (or after) the
backbone runs — the pinned run id and the API URLs volunteers should use."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from shared.errors import ConfigError

__all__ = ["RunInfo", "read_run_info", "write_run_info"]

RUN_INFO = "run.json"


class RunInfo(msgspec.Struct, frozen=True):
    run_id: str
    api: list[str]
    authority_public_key: str


def write_run_info(data_dir: Path, info: RunInfo) -> None:
    """Atomically write ``run.json``, readable by its owner only (0600 whatever the umask)."""
    tmp = data_dir / (RUN_INFO + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.encode(info))
    tmp.replace(data_dir / RUN_INFO)


def read_run_info(data_dir: Path) -> RunInfo:
    """Raises ConfigError if the backbone of ``data_dir`` never started a pinned run."""
    try:
        return msgspec.json.decode((data_dir / RUN_INFO).read_bytes(), type=RunInfo)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{data_dir} holds no run: start `backbone start --data-dir {data_dir}` once first "
            "(it records the run id and API address that invites carry)"
        ) from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{data_dir / RUN_INFO} is damaged: {exc}") from exc
