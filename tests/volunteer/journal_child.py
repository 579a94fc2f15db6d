"""A volunteer's reporter killed mid-run: records steps (with another user's receipts) and is SIGKILLed
at the fault point ``test.steps_recorded`` (armed through ``DEDLOC_FAULTS`` by the test).

Usage: ``python -m tests.volunteer.journal_child DATA_DIR RUN_ID STEPS`` (from the repository root).
The reporter's interval is 2.5 s of step time and step ``i`` finishes at ``start + i``, so steps 1-3 go
into report 0 (queued, never sent: no backbone answers) and the later ones are open when it dies.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shared import faults
from tests.backbone.ledger.reports import identity, part_receipt
from volunteer.api_client import ApiClient
from volunteer.journal import JournaledStep
from volunteer.reporting import Reporter

VOLUNTEER = identity(61)
WITNESS = identity(62)  # a peer of another user: it aggregated our parts
SAMPLES = 32


def main(data_dir: str, run_id: str, steps: int) -> None:
    offline = ApiClient(run_id, ["https://127.0.0.1:9"])
    reporter = Reporter(run_id, VOLUNTEER, offline, Path(data_dir), interval=2.5)
    start = time.time()
    for number in range(1, steps + 1):
        signed = part_receipt(WITNESS, VOLUNTEER.peer_id, number, SAMPLES, run_id, 100, start)
        reporter.book.add(number, [(WITNESS.peer_id, signed)])
        reporter.record(JournaledStep(number, SAMPLES, 0.5, 0, start + number))
    print(f"{reporter.pending} queued", flush=True)
    faults.hit("test.steps_recorded")
    print("not killed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
