"""``shared.console.run_service``: the project's errors become one line and an exit code; anything else keeps
its traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from shared.console import locked_data_dir, run_service
from shared.errors import ConfigError, PeerUnavailable
from shared.lifecycle import Shutdown

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def exit_code_and_stderr(error: BaseException, capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    async def body(shutdown: Shutdown) -> None:
        async with trio.open_nursery() as outer:  # nested nurseries, as a service's tasks are

            async def fail() -> None:
                async with trio.open_nursery() as inner:
                    inner.start_soon(trio.sleep_forever)
                    raise error

            outer.start_soon(fail)

    with pytest.raises(SystemExit) as caught:
        run_service(body)
    return caught.value.code, capsys.readouterr().err


def test_run_service_unwraps_a_config_error_from_nested_nurseries_to_exit_2_and_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = exit_code_and_stderr(ConfigError("cannot serve the API on 0.0.0.0:8443: in use"), capsys)
    assert code == 2
    assert err == "error: cannot serve the API on 0.0.0.0:8443: in use\n"


def test_run_service_maps_other_project_errors_to_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = exit_code_and_stderr(PeerUnavailable("no initial peer answered"), capsys)
    assert code == 1
    assert err == "error: no initial peer answered\n"


def test_run_service_prints_a_long_multi_line_message_with_brackets_as_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = "ledger: OperationalError: connection refused\n\tIs the server running? [training] " + "x" * 300
    code, err = exit_code_and_stderr(ConfigError(message), capsys)
    assert code == 2
    assert err.splitlines() == [" ".join(f"error: {message}".split())]  # [training] is text, not markup


def test_run_service_keeps_the_traceback_of_an_unexpected_error_beside_a_project_error() -> None:
    async def body(shutdown: Shutdown) -> None:
        async with trio.open_nursery() as nursery:

            async def bug() -> None:
                raise RuntimeError("a bug")

            async def refused() -> None:
                raise ConfigError("bad input")

            nursery.start_soon(bug)
            nursery.start_soon(refused)

    with pytest.raises(BaseExceptionGroup) as caught:
        run_service(body)
    assert caught.group_contains(RuntimeError, match="a bug", depth=None)  # type: ignore[attr-defined]


def test_a_data_dir_that_is_a_file_is_refused_with_the_next_step(tmp_path: Path) -> None:
    (tmp_path / "bb").write_text("")
    lock = locked_data_dir(tmp_path / "bb")
    with pytest.raises(ConfigError, match="is a file, not a directory; give another --data-dir"):
        lock.__enter__()
