"""Crash-test writer: records reports in a loop and prints each seq once its commit has returned.

Usage: ``python -m tests.backbone.ledger.crash_writer DATABASE_URL`` (from the repository root). Prints
``ready`` once its user and peer exist, then ``<seq>`` per committed report, until killed (or 100,000).
"""

from __future__ import annotations

import sys
import time

from backbone.ledger import LedgerStore
from backbone.ledger.accounting import CREDITED

from .reports import CAPS, identity, make_report, sign

WRITER = identity(42)
USERNAME = "crash-writer"
MAX_REPORTS = 100_000


def main(url: str) -> None:
    with LedgerStore.open(url) as store:
        now = time.time()
        store.add_user(USERNAME, now=now)
        secret = store.create_invite(USERNAME, now=now)
        store.redeem_invite(secret, WRITER.peer_id, WRITER.public_key_bytes, now=now)
        store.update_capabilities(WRITER.peer_id, CAPS, now=now)
        print("ready", flush=True)
        for seq in range(MAX_REPORTS):
            report = make_report(WRITER, seq)
            store.record_report(sign(WRITER, report), report, CREDITED, now=time.time())
            print(seq, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
