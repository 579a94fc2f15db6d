"""What each role installs beyond the base install, and the one line a command prints when it lacks it.

The project installs as ``dedloc[backbone]`` on a server and ``dedloc[volunteer]`` on a volunteer's machine
(pyproject's optional dependencies; ``scripts/setup`` installs both). Each CLI imports its role's packages
only in the commands that need them, so ``--help`` always works; a command whose package is missing ends
with exit 2 (unusable input, as a missing task plugin) and the ``pip install`` line that fixes it, never
with a traceback: ``pip install dedloc`` alone, without the role, is an easy mistake to make.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from .console import fail

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["ROLE_PACKAGES", "Role", "missing_role_package", "role_installed"]

Role = Literal["backbone", "volunteer"]

#: the top-level modules of each role's extra (tests/packaging checks they are pyproject's, name for name)
ROLE_PACKAGES: dict[Role, frozenset[str]] = {
    "backbone": frozenset({"sqlalchemy", "psycopg", "starlette", "hypercorn", "tokenizers"}),
    "volunteer": frozenset({"httpx", "torch", "datasets", "transformers", "tokenizers"}),
}


def missing_role_package(exc: BaseException, role: Role) -> str | None:
    """The package of ``role``'s extra whose absence ``exc`` reports, if that is all ``exc`` reports.

    ``exc`` is a ``ModuleNotFoundError`` of one of those packages (or of a module inside one), or a group
    (a nursery's) of nothing else; anything else is another failure, and gives None.
    """
    if isinstance(exc, ModuleNotFoundError):
        package = (exc.name or "").partition(".")[0]
        return package if package in ROLE_PACKAGES[role] else None
    if isinstance(exc, BaseExceptionGroup):
        missing = [missing_role_package(inner, role) for inner in exc.exceptions]
        if missing and all(missing):
            return missing[0]
    return None


@contextmanager
def role_installed(role: Role) -> Iterator[None]:
    """Around a CLI: a package of ``role``'s extra that cannot be imported ends it with one line, exit 2."""
    try:
        yield
    except BaseException as exc:
        package = missing_role_package(exc, role)
        if package is None:
            raise
        fail(
            f"the {role} needs the {package} package, which this Python environment lacks; install the "
            f"{role}'s packages with: pip install 'dedloc[{role}]'",
            2,
        )
