"""``run.json`` in a backbone's data dir: what ``backbone allow`` needs to mint invites while (or after) the
backbone runs — the pinned run id and the API URLs volunteers should use.

A data dir holds one run for good: invites already issued carry its id, its ledger credits its volunteers
and its checkpoints are its model. So ``backbone start`` on a data dir whose ``run.json`` names another run
(a typo'd ``--run-id``, ``--open``, or another authority key) is refused before anything is written
(:func:`check_held_run`), and the message says which run the data dir holds and how to start it. The
same name in its full form ``name@fingerprint`` is that run (a second backbone starts that way).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from protocols.auth import split_run_id
from protocols.training import TrainingSpec
from shared.errors import ConfigError

__all__ = [
    "RUN_INFO",
    "SERVED_SPEC",
    "RunInfo",
    "check_held_run",
    "held_run_conflict",
    "read_run_info",
    "read_served_spec",
    "write_run_info",
    "write_served_spec",
]

RUN_INFO = "run.json"
SERVED_SPEC = "training.json"  # the training spec the backbone serves (tokenizer pinned), for `export`


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
            f"{data_dir} holds no run yet: start it once with `backbone start --run-id NAME --data-dir "
            f"{data_dir}` (that records the run id and API address invites carry)"
        ) from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"{data_dir / RUN_INFO} is damaged ({exc}); restore it, or remove it and start the run again "
            "with its --run-id (the authority key in the data dir keeps its id)"
        ) from exc


def held_run_conflict(
    held: RunInfo, requested: str, *, open_run: bool = False, authority_public_key: str | None = None
) -> str | None:
    """Why a backbone asked to serve ``requested`` must not start on a data dir holding ``held`` (None if it
    may): another name, another fingerprint, ``--open``, or (once the authority key is loaded) another key.
    """
    name, fingerprint = split_run_id(requested)
    held_name, held_fingerprint = split_run_id(held.run_id)
    how = f"start it with --run-id {held_name}, or give another --data-dir for a new run"
    if open_run:
        return f"this data dir holds the pinned run {held.run_id}, so it cannot serve an open run: {how}"
    other = f"this data dir holds run {held.run_id}, not {requested} (invites carry that id): {how}"
    if name != held_name:
        return other
    if authority_public_key is not None and authority_public_key != held.authority_public_key:
        return (
            f"the authority key given is not the one of run {held.run_id}, which this data dir holds: "
            "use that run's authority.key, or give another --data-dir for a new run"
        )
    if fingerprint is not None and fingerprint != held_fingerprint:
        return other
    return None


def check_held_run(
    data_dir: Path, requested: str, *, open_run: bool = False, authority_public_key: str | None = None
) -> RunInfo | None:
    """The run ``data_dir`` holds (None for a fresh one) if a backbone may serve ``requested`` there.

    Raises:
        ConfigError: it holds another run (:func:`held_run_conflict`), or its ``run.json`` is damaged.
    """
    if not (data_dir / RUN_INFO).exists():
        return None
    held = read_run_info(data_dir)
    conflict = held_run_conflict(
        held, requested, open_run=open_run, authority_public_key=authority_public_key
    )
    if conflict is not None:
        raise ConfigError(f"{data_dir}: {conflict}")
    return held


def write_served_spec(data_dir: Path, spec: TrainingSpec) -> None:
    """Keep the training spec this backbone serves (with its tokenizer's SHA-256) in ``training.json``:
    ``backbone export --format hf`` builds the model's config from it."""
    tmp = data_dir / (SERVED_SPEC + ".tmp")
    tmp.write_bytes(msgspec.json.encode(spec))
    tmp.replace(data_dir / SERVED_SPEC)


def read_served_spec(data_dir: Path) -> TrainingSpec:
    """Raises ConfigError if the backbone of ``data_dir`` never served a run (or the file is damaged)."""
    path = data_dir / SERVED_SPEC
    try:
        return msgspec.json.decode(path.read_bytes(), type=TrainingSpec)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{data_dir} holds no {SERVED_SPEC}: start the run's backbone once with this data dir (it "
            "records the training spec it serves there)"
        ) from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{path} is damaged ({exc}); start the backbone again to rewrite it") from exc
