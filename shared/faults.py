"""Named fault points: tests kill or fail a process at a named point of a protocol, deterministically.

Timing-based fault tests ("kill it 2.5 s in, it is probably averaging by then") fail under load and test
nothing when they miss. Instead, code marks the moments worth breaking with a *named point*::

    faults.hit("allreduce.after_push")          # synchronous code
    await faults.point("state.mid_download")    # async code (also a trio checkpoint)

An unarmed point costs one dict lookup. A test arms a point, in-process with :func:`arm` (undone by
:func:`disarm`), or in a child process through the environment variable :data:`ENV`::

    DEDLOC_FAULTS="allreduce.after_push=kill@2,state.mid_download=raise"

Each entry is ``name=action[@n]``: fire on the ``n``-th hit of ``name`` (default the first), once.
Actions:

* ``kill`` -- SIGKILL ourselves (what an out-of-memory kill or a pulled plug does: no cleanup at all);
* ``exit`` -- ``os._exit(70)`` (the same, with a recognisable status);
* ``raise`` -- raise :class:`FaultInjected` (a :class:`~protocols.errors.ProjectError`, so it travels the
  same paths as a real failure);
* ``hang`` -- block forever (async points only; a synchronous point raises instead): a member that stops
  answering without closing its connections;
* ``stop`` -- SIGSTOP ourselves: the whole process freezes with every connection open (a hung or swapped
  out machine); whoever started it ends it with SIGKILL (or resumes it with SIGCONT).

**Several members in one process.** Points are process-wide, so a test that runs several members in one
trio run tags each member's task with :func:`scope` (a context variable, inherited by the tasks it
starts) and arms a point for one tag only (``arm(name, action, where=tag)``): that entry counts and fires
only on hits made under the tag.

The list of points is not fixed: any name works, and :func:`hits` tells a test how often a point was
passed. Points in use: ``matchmaking.joined`` (our ticket is stored, the plan not read yet),
``allreduce.after_push`` (once per round, when all our parts went out), ``allreduce.after_serve`` (an
averaged part of our slice was sent to a member), ``allreduce.before_result`` (every
exchange of the round ended, before the averages are written back), ``state.mid_download`` (after each
chunk of a state download but the last), ``state.serve`` (a peer asked us for a chunk of a state, before
it is served), ``state.before_load`` (downloaded and checked, not loaded yet), ``step.after_apply``
(stepped; nothing reported or published yet).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import trio

from protocols.errors import ProjectError

__all__ = ["ENV", "FaultInjected", "arm", "disarm", "hit", "hits", "parse", "point", "scope"]

ENV = "DEDLOC_FAULTS"
ACTIONS = ("kill", "exit", "raise", "hang", "stop")
EXIT_STATUS = 70


class FaultInjected(ProjectError):
    """A fault point armed with ``raise`` fired."""


@dataclass
class _Armed:
    action: str
    on_hit: int  # fire on this hit (1-based)
    where: str | None = None  # only hits made under this scope tag count
    seen: int = 0  # hits counted so far (scoped entries)


_armed: dict[str, _Armed] = {}
_hits: Counter[str] = Counter()
_scope: ContextVar[str | None] = ContextVar("dedloc_fault_scope", default=None)


@contextlib.contextmanager
def scope(tag: str) -> Iterator[None]:
    """Tag the current task (and the tasks it starts from now on) for points armed ``where=tag``."""
    token = _scope.set(tag)
    try:
        yield
    finally:
        _scope.reset(token)


def parse(text: str) -> dict[str, tuple[str, int]]:
    """``"a=kill@2,b=raise"`` -> ``{"a": ("kill", 2), "b": ("raise", 1)}``.

    Raises:
        ValueError: an entry is malformed or names an unknown action.
    """
    out: dict[str, tuple[str, int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, rest = entry.partition("=")
        action, _, count = rest.partition("@")
        if not sep or not name or action not in ACTIONS:
            raise ValueError(f"fault entry {entry!r}: expected name=action[@n], action one of {ACTIONS}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"fault entry {entry!r}: @{count} is not a number") from None
        if n < 1:
            raise ValueError(f"fault entry {entry!r}: @n counts from 1")
        out[name] = (action, n)
    return out


def arm(name: str, action: str, on_hit: int = 1, *, where: str | None = None) -> None:
    """Fire ``action`` at the ``on_hit``-th hit of ``name`` from now on (once); with ``where``, count and
    fire only on hits made under :func:`scope` ``(where)``."""
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r} (one of {ACTIONS})")
    if where is None:
        _armed[name] = _Armed(action, _hits[name] + on_hit)
    else:
        _armed[name] = _Armed(action, on_hit, where)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them (and forget the hit counts) with no name."""
    if name is None:
        _armed.clear()
        _hits.clear()
    else:
        _armed.pop(name, None)


def hits(name: str) -> int:
    return _hits[name]


def _due(name: str) -> str | None:
    _hits[name] += 1
    armed = _armed.get(name)
    if armed is None:
        return None
    if armed.where is not None:
        if _scope.get() != armed.where:
            return None
        armed.seen += 1
        if armed.seen != armed.on_hit:
            return None
    elif _hits[name] != armed.on_hit:
        return None
    del _armed[name]
    if armed.action == "kill":
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows: TerminateProcess
    if armed.action == "exit":
        os._exit(EXIT_STATUS)
    if armed.action == "stop":
        if sys.platform != "win32":  # Windows cannot stop a process: the fault is a no-op there
            os.kill(os.getpid(), signal.SIGSTOP)
        return None  # resumed by SIGCONT: carry on
    return armed.action


def hit(name: str) -> None:
    """A synchronous fault point (``hang`` raises here: blocking a thread would hang the test itself)."""
    if not _armed:
        _hits[name] += 1
    elif _due(name) is not None:
        raise FaultInjected(f"fault injected at {name}")


async def point(name: str) -> None:
    """An async fault point; also a trio checkpoint only when armed (so unarmed points cost nothing)."""
    if not _armed:
        _hits[name] += 1
        return
    action = _due(name)
    if action == "hang":
        await trio.sleep_forever()
    if action == "raise":
        raise FaultInjected(f"fault injected at {name}")


def _arm_from_environment() -> None:
    text = os.environ.get(ENV, "")
    if text:
        for name, (action, n) in parse(text).items():
            arm(name, action, n)


_arm_from_environment()
