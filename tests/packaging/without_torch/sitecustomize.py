"""Makes a Python process one without the volunteer's packages, as on a server that installed
``dedloc[backbone]``: put this folder first on ``PYTHONPATH`` and ``site`` imports this module at start-up.

Every import of a top-level package named in ``$DEDLOC_FORBID`` (comma-separated, e.g.
``torch,transformers,datasets``) fails as if it were not installed (``ModuleNotFoundError``), and is
recorded, with the stack that asked for it, in the file ``$DEDLOC_FORBID_LOG``: an import that the code
catches (``try: import torch except ImportError``) still shows there, so a test can fail on any attempt.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

FORBIDDEN = frozenset(name for name in os.environ.get("DEDLOC_FORBID", "").split(",") if name)
LOG = os.environ.get("DEDLOC_FORBID_LOG", "")


class ForbidFinder:
    """A ``sys.meta_path`` finder consulted before the real ones: it refuses the forbidden packages."""

    @staticmethod
    def find_spec(
        name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.partition(".")[0] not in FORBIDDEN:
            return None  # the next finder looks for it
        if LOG:
            with open(LOG, "a", encoding="utf-8") as log:
                log.write(f"import {name} refused in process {os.getpid()}:\n")
                log.write("".join(traceback.format_stack()[:-1]))
        raise ModuleNotFoundError(f"No module named {name!r} (refused by {__file__})", name=name)


if FORBIDDEN:
    sys.meta_path.insert(0, ForbidFinder())
