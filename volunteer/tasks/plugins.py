"""Tasks of installed plugins: an organizer's own model, data pipeline and loss as a Python package.

A plugin is an installed distribution that exposes a task factory under the entry point group
:data:`ENTRY_POINT_GROUP` (``dedloc.tasks``), named as the task, with the interface of the built-in tasks
(:class:`~volunteer.tasks.base.Task`; the factory is called as ``factory(spec, tokenizer)`` like those of
:data:`~volunteer.tasks.registry.TASKS`)::

    # the plugin's pyproject.toml
    [project.entry-points."dedloc.tasks"]
    protein-mlm = "protein_task:ProteinMLM"

A run names it with the distribution and exact version it needs (``task = "protein-mlm"``, ``plugin =
"protein-task==1.2.0"``). **A volunteer never runs code fetched from the network**: :func:`plugin_factory`
looks only at what is installed on the volunteer's machine, and a missing distribution, another version,
or one without that entry point stops ``volunteer join`` (exit 2) with the exact ``pip install`` line
to run. Only then is the entry point loaded (importing the installed package).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from shared.errors import ConfigError

__all__ = ["ENTRY_POINT_GROUP", "plugin_factory"]

ENTRY_POINT_GROUP = "dedloc.tasks"


def plugin_factory(task: str, requirement: str) -> Callable[..., Any]:
    """The factory of ``task`` from the installed distribution ``requirement`` (``name==version``).

    Raises:
        ConfigError: the distribution is not installed, has another version, has no such entry point,
            or its entry point cannot be imported (each message gives what to run).
    """
    name, _, version = requirement.partition("==")
    install = f"pip install '{requirement}'"
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"this run's task {task!r} comes from the plugin {requirement}, which is not installed here: "
            f"run `{install}` (in this volunteer's environment), then join again"
        ) from None
    if dist.version != version:
        raise ConfigError(
            f"this run's task {task!r} needs the plugin {requirement}, but {name} {dist.version} is "
            f"installed: run `{install}`, then join again"
        )
    points = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP and ep.name == task]
    if not points:
        have = sorted(ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
        raise ConfigError(
            f"the plugin {requirement} has no {ENTRY_POINT_GROUP} entry point {task!r} (it has "
            f"{', '.join(have) or 'none'}): the run's manifest and the plugin disagree; tell the organizer"
        )
    try:
        factory = points[0].load()
    except Exception as exc:  # an installed package that fails to import: its own error, in one line
        raise ConfigError(
            f"the plugin {requirement} is installed but its task {task!r} cannot be loaded "
            f"({type(exc).__name__}: {exc}); reinstall it with `{install} --force-reinstall`"
        ) from exc
    if not callable(factory):
        raise ConfigError(f"the plugin {requirement}'s entry point {task!r} is not a task factory")
    return factory  # type: ignore[no-any-return]
