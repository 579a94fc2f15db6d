"""Issue 10's churn soak in CI (``scripts/soak.py``, shortened): real processes, a seeded fault schedule
(volunteers SIGKILLed and restarted, two at once, one in its state download, the backbone SIGKILLed and
restarted on its ports and data dir), then only invariants are asserted, never stall times.

One soak runs per module (a backbone, 3 volunteers, the small model, 70 s of faults); each invariant is
its own test so that the lead sees which hold. The soak's whole JSON report (and its work dir, with one log
per process) is printed when an assertion fails.

Wall time on the shared 2-core machine (load 6-11): about 110 s for the module's soak, 150 s for
``test_two_backbones``. Whether a fork happens depends on timing, so a test below may pass by luck on a
main that still forks; each failure prints the figures and the work dir (one log per process).

Status, measured with these tests:

* on 7f02799 (before the DHT healing and the optimizer split), three runs: two ended with forks
  (``test_no_fork_but_resync_discards`` failed). In one, every volunteer had been restarted and they
  re-synced to a restarted peer's step-0 state: the run started over at step 1 (what
  ``test_the_run_does_not_start_over``, added after, checks). One run also failed
  ``test_credited_at_most_computed`` (its report was not kept); one run passed everything;
* on 7c2234e (main with fix/heal merged): the five single-backbone tests pass (one run);
  ``test_two_backbones`` FAILS: after backbone 1 was lost the run split (two volunteers at step 21, one
  alone at step 94, 21 disagreeing steps) and backbone 2 recorded no step after the loss (a lone
  volunteer's progress is not credible, and the other two were stuck in failing rounds).

The two-backbone variant (item 7: one ledger on PostgreSQL, failover) is ``test_two_backbones``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .procs import ENV

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
#: the soak's own limits: start-up (torch imports on a busy machine) + 80 s + settle + stop
TIMEOUT_S = 900


def run_soak(work: Path, *extra: str) -> dict[str, Any]:
    argv = [sys.executable, str(SOAK), "--json", "--work-dir", str(work), "--small", "--volunteers", "3"]
    result = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, env=ENV, timeout=TIMEOUT_S, check=False
    )
    failed = f"the soak itself failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode in (0, 1), failed
    report: dict[str, Any] = json.loads(result.stdout)
    return report


KEYS = (
    "work_dir", "load_average", "steps", "final", "unexplained_forks", "fork_steps_sample",
    "discarded_by_resync", "samples", "per_volunteer", "overcredited", "after_backbone_lost",
    "exit_codes", "events", "failures",
)  # fmt: skip


def shown(report: dict[str, Any]) -> str:
    """The figures an assertion is about, and the work dir with one log per process."""
    return json.dumps({key: report.get(key) for key in KEYS}, indent=1)


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("soak") / "work"
    return run_soak(work, "--seconds", "70", "--seed", "3", "--settle", "45")


def test_one_collaboration_at_the_end(soak: dict[str, Any]) -> None:
    """Every volunteer that is back in the run holds the same parameters (FAILS on main: a lone fork)."""
    assert soak["final"]["one_collaboration"], shown(soak)
    assert len(soak["final"]["last_steps"]) >= 2, shown(soak)


def test_no_fork_but_resync_discards(soak: dict[str, Any]) -> None:
    """A step taken by several peers has one fingerprint, except where a peer that stepped on a stale state
    re-synced right after (FAILS on main: the lone fork after the backbone restart)."""
    assert soak["unexplained_forks"] == 0, shown(soak)


def test_the_run_does_not_start_over(soak: dict[str, Any]) -> None:
    """The collaboration ends at a later step than it was at when the faults began: restarted volunteers
    resume the run's state (a peer's or a backbone checkpoint), they never drag it back to step 0."""
    assert "progress_kept" not in soak["failures"], shown(soak)


def test_credited_at_most_computed(soak: dict[str, Any]) -> None:
    """The ledger credits no more than the surviving collaboration computed, in total and per volunteer."""
    assert soak["samples"]["credited"] <= soak["samples"]["computed"], shown(soak)
    assert not soak["overcredited"], shown(soak)
    assert soak["samples"]["credited"] > 0, shown(soak)  # the check is not vacuous


def test_volunteers_leave_cleanly(soak: dict[str, Any]) -> None:
    assert soak["exit_codes"] and all(code == 0 for code in soak["exit_codes"].values()), shown(soak)


def test_two_backbones(tmp_path: Path) -> None:
    """Item 7: two backbones on one ledger database (PostgreSQL when installed); backbone 1 — the one the
    volunteers were invited through, first in their API and DHT lists — is SIGKILLed for good: reports
    still reach the ledger through backbone 2, nothing is credited twice, the volunteers keep stepping."""
    report = run_soak(
        tmp_path / "work", "--backbones", "2", "--lost-backbone", "1", "--seconds", "80", "--seed", "5",
        "--settle", "45",
    )  # fmt: skip
    after = report["after_backbone_lost"]
    assert after is not None and after["reports_received"] > 0, shown(report)  # failover of the API
    assert report["samples"]["credited"] <= report["samples"]["computed"], shown(report)  # once
    assert not report["overcredited"], shown(report)
    assert all(code == 0 for code in report["exit_codes"].values()), shown(report)
    # The run survives: the volunteers go on as one collaboration and backbone 2 records its steps.
    assert report["final"]["one_collaboration"] and report["unexplained_forks"] == 0, shown(report)
    assert after["steps_recorded"] > 0, shown(report)
