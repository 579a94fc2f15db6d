"""The volunteer's config file: every ``volunteer join`` flag as a TOML key, so that a service or a notebook
needs no long command line.

**Where.** ``--config FILE``; without it ``volunteer.toml`` in the data dir (``--data-dir``, else
``$VOLUNTEER_DATA_DIR``, else the default), when that file exists.

**Keys.** A flag's long name without its dashes (``micro-batch = 8``; ``micro_batch`` is accepted too), the
run id as ``run-id``; ``--panel/--no-panel`` is ``panel = true|false``; a repeatable flag takes an array
(``initial-peer = ["/ip4/…", "/ip4/…"]``). Example::

    run-id = "my-run@4fT9…"
    device = "cuda:1"
    micro-batch = 16
    panel = false
    initial-peer = ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…"]

**Precedence**, highest first: the command line; the environment, ``VOLUNTEER_<KEY>`` (upper case, ``-`` as
``_``: ``VOLUNTEER_MICRO_BATCH=8``, ``VOLUNTEER_PANEL=false``; a repeatable flag's values separated by
spaces); the config file; the built-in default.

**Errors** are the user's input, so they stop ``volunteer join`` with exit 2 and one line naming the file
or variable and the key: a file that is not TOML, a key that is no flag (with the nearest flag's name), a
value the flag would refuse. Nothing here imports more than the standard library and the CLI's own
parameters (``volunteer --help`` stays instant).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.console import default_data_dir
from shared.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["CONFIG_NAME", "ENV_PREFIX", "config_path", "join_defaults", "parameter_keys"]

#: The config file's name in the data dir.
CONFIG_NAME = "volunteer.toml"
ENV_PREFIX = "VOLUNTEER_"
#: Keys that select the config file itself: never read from it.
_NOT_IN_FILE = {"config"}
#: The config file is larger than any real one (a few hundred bytes) long before this.
_MAX_CONFIG_BYTES = 64 * 1024


def parameter_keys(command: Any) -> dict[str, Any]:
    """The config keys of ``command``'s (a click command's) parameters: ``{key: parameter}``, the key
    being the longest ``--flag`` without dashes (an argument's name with ``-`` for ``_``)."""
    keys: dict[str, Any] = {}
    for param in command.params:
        flags = [opt for opt in param.opts if opt.startswith("--")]
        key = max(flags, key=len)[2:] if flags else param.name.replace("_", "-")
        keys[key] = param
    return keys


def _option_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` on the command line (``--flag V`` or ``--flag=V``; the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def config_path(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[Path | None, bool]:
    """The config file to read and whether it was asked for (``--config``: it must exist)."""
    given = _option_value(argv, "--config")
    if given is not None:
        return Path(given).expanduser(), True
    data_dir = _option_value(argv, "--data-dir") or environ.get(f"{ENV_PREFIX}DATA_DIR")
    directory = Path(data_dir).expanduser() if data_dir else default_data_dir("volunteer")
    candidate = directory / CONFIG_NAME
    return (candidate if candidate.is_file() else None), False


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is over {_MAX_CONFIG_BYTES} bytes: not a volunteer's config")
    try:
        parsed: dict[str, Any] = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    return parsed


def _checked(param: Any, value: Any, where: str) -> Any:
    """``value`` as ``param`` takes it (click converts it the same way again when it parses)."""
    if param.multiple or getattr(param, "nargs", 1) == -1:
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list):
            raise ConfigError(f"{where}: give a list of values")
        items = value
    else:
        if isinstance(value, list | dict):
            raise ConfigError(f"{where}: give one value, not {type(value).__name__}")
        items = [value]
    for item in items:
        if isinstance(item, list | dict):
            raise ConfigError(f"{where}: {item!r} is not a single value")
        try:
            param.type.convert(item, param, None)
        except Exception as exc:  # click's BadParameter, from the CLI's own click (typer's copy or not)
            message = getattr(exc, "message", None) or str(exc)
            raise ConfigError(f"{where}: {message}") from exc
    return value


def _unknown(key: str, keys: Mapping[str, Any], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, list(keys), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{where}: no flag --{key}{hint}; the keys are the long flags of `volunteer join`")


def join_defaults(command: Any, argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults ``volunteer join`` (click ``command``) takes from the config file and the environment,
    by parameter name (click's ``default_map`` for the command). The command line overrides them all.

    Raises:
        ConfigError: the file or a variable is unusable (module docstring, "Errors").
    """
    keys = parameter_keys(command)
    by_name = {param.name: key for key, param in keys.items()}
    defaults: dict[str, Any] = {}
    path, asked = config_path(argv, environ)
    if path is not None:
        if asked and not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        for raw, value in _read(path).items():
            key = raw if raw in keys else by_name.get(raw, raw)
            where = f"config file {path}: {raw}"
            if key not in keys or key in _NOT_IN_FILE:
                raise _unknown(raw, {k: v for k, v in keys.items() if k not in _NOT_IN_FILE}, where)
            param = keys[key]
            defaults[param.name] = _checked(param, value, where)
    for key, param in keys.items():
        variable = ENV_PREFIX + key.upper().replace("-", "_")
        if key in _NOT_IN_FILE or variable not in environ:
            continue
        defaults[param.name] = _checked(param, environ[variable], f"${variable}")
    return defaults
