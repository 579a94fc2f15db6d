"""Hypothesis profiles: under CI (``CI`` set, as ``.ci/run`` is run) the property tests draw the same
examples every run (``derandomize``), so a red CI is a change's doing, never a new draw; on a developer's
machine they explore (and keep what fails in ``.hypothesis/``). No deadline in either: a test that
fails only under load is a bug, and a per-example deadline is exactly that."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
