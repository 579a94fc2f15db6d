"""Which failures ``shared.extras`` turns into the one-line "install the role's packages" error."""

from __future__ import annotations

import sys

import pytest

from shared.extras import missing_role_package, role_installed

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup


def missing(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_a_missing_package_of_the_role_is_named() -> None:
    assert missing_role_package(missing("torch"), "volunteer") == "torch"
    assert missing_role_package(missing("transformers.models.albert"), "volunteer") == "transformers"
    assert missing_role_package(missing("hypercorn.trio"), "backbone") == "hypercorn"
    nursery = ExceptionGroup("", [missing("httpx"), ExceptionGroup("", [missing("torch")])])
    assert missing_role_package(nursery, "volunteer") == "httpx"


@pytest.mark.parametrize(
    "exc",
    [
        missing("sqlalchemy"),  # the backbone's, not the volunteer's
        missing("volunteer.tasks.nonexistent"),  # our own code is broken: a traceback helps
        ModuleNotFoundError("no name"),
        ImportError("cannot import name 'x' from 'torch'", name="torch"),  # torch is there, but broken
        ExceptionGroup("", [missing("torch"), ValueError("another failure")]),
        BaseExceptionGroup("", [missing("torch"), KeyboardInterrupt()]),
        ValueError("torch"),
    ],
)
def test_anything_else_is_not_a_missing_role_package(exc: BaseException) -> None:
    assert missing_role_package(exc, "volunteer") is None


def test_role_installed_exits_2_with_the_pip_line_and_lets_other_errors_through(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited, role_installed("volunteer"):
        raise missing("datasets")
    assert exited.value.code == 2
    assert "pip install 'dedloc[volunteer]'" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError), role_installed("backbone"):
        raise missing("torch")
