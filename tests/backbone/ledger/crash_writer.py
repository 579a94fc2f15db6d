"""Crash-test writer: records reports in a loop and prints each seq once its commit has returned.

Usage: ``python -m tests.backbone.ledger.crash_writer DATABASE_URL`` (from the repository root). Prints
``ready`` once its user and peer exist, then ``<seq>`` per committed report, until killed (or 100,000).
"""

from __future__ import annotations

import sys
import time

from backbone.ledger import LedgerStore
from backbone.ledger.accounting import CREDITED

from .reports import CAPS, identity, make_report, receipt, sign

WRITER = identity(42)
WITNESS = identity(43)  # a peer of another user, whose receipts back the writer's reports
USERNAME = "crash-writer"
MAX_REPORTS = 100_000


def main(url: str) -> None:
    with LedgerStore.open(url) as store:
        now = time.time()
        store.add_user(USERNAME, now=now)
        secret = store.create_invite(USERNAME, now=now)
        store.redeem_invite(secret, WRITER.peer_id, WRITER.public_key_bytes, now=now)
        store.update_capabilities(WRITER.peer_id, CAPS, now=now)
        store.add_user("witness", now=now)
        secret = store.create_invite("witness", now=now)
        store.redeem_invite(secret, WITNESS.peer_id, WITNESS.public_key_bytes, now=now)
        print("ready", flush=True)
        for seq in range(MAX_REPORTS):
            store.record_step(seq, finished_at=now, loss=None, samples=0, peers=2)
            report = make_report(WRITER, seq, receipts=[receipt(WITNESS, WRITER, seq, 1000)])
            store.record_report(sign(WRITER, report), report, CREDITED, now=time.time())
            print(seq, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
