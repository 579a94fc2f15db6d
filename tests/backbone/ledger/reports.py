"""Building and signing contribution reports for ledger tests (also used by the crash-test writer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols.ledger import (
    Capabilities,
    ContributionReport,
    ReceivedBytes,
    RelayedBytes,
    SignedReport,
    StageStepRange,
    StepRange,
    report_payload,
)
from protocols.receipts import (
    PartReceipt,
    PulledSlice,
    SignedReceipt,
    sign_receipt,
)
from shared.auth.keys import Identity

if TYPE_CHECKING:
    from backbone.ledger import LedgerStore

RUN_ID = "ledger-test"
T0 = 1_700_000_000.0
CAPS = Capabilities(samples_per_second=100.0, upload_bps=1e6, download_bps=1e6, device="test-cpu")


def admit_users(store: LedgerStore, users: dict[str, Identity], now: float) -> None:
    """Each ``username: identity`` a user with its peer admitted (an invite redeemed) and :data:`CAPS`."""
    for username, who in users.items():
        store.add_user(username, now=now)
        secret = store.create_invite(username, now=now)
        store.redeem_invite(secret, who.peer_id, who.public_key_bytes, now=now)
        store.update_capabilities(who.peer_id, CAPS, now=now)


def identity(n: int) -> Identity:
    """A deterministic identity per ``n`` (1..255)."""
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32))


def make_report(
    who: Identity,
    seq: int,
    *,
    start: float | None = None,
    length: float = 60.0,
    samples: int = 1000,
    compute_seconds: float | None = None,
    bytes_aggregated: int = 0,
    bytes_relayed: int = 0,
    global_step: int | None = None,
    run_id: str = RUN_ID,
    receipts: list[SignedReceipt] | None = None,
    pulled: list[PulledSlice] | None = None,
    discarded: list[tuple[int, int]] | None = None,
    relayed: dict[str, int] | None = None,
    bytes_sent: int = 0,
    received: dict[str, int] | None = None,
    stage_discarded: list[tuple[int, int, int]] | None = None,
) -> ContributionReport:
    """Report ``seq`` of ``who``: by default the ``seq``-th minute after T0, plausible for :data:`CAPS`."""
    begin = T0 + seq * length if start is None else start
    return ContributionReport(
        run_id=run_id,
        peer_id=who.peer_id,
        seq=seq,
        global_step=seq if global_step is None else global_step,
        samples=samples,
        compute_seconds=length if compute_seconds is None else compute_seconds,
        bytes_aggregated=bytes_aggregated,
        bytes_relayed=bytes_relayed,
        interval_start=begin,
        interval_end=begin + length,
        receipts=receipts or [],
        pulled=pulled or [],
        discarded=[StepRange(a, b) for a, b in discarded or []],
        relayed_through=[RelayedBytes(relay, n) for relay, n in (relayed or {}).items()],
        bytes_sent=bytes_sent,
        received_from=[ReceivedBytes(server, n) for server, n in (received or {}).items()],
        stage_discarded=[StageStepRange(k, a, b) for k, a, b in stage_discarded or []],
    )


def receipt(
    aggregator: Identity,
    sender: Identity,
    step: int,
    weight: float,
    *,
    nbytes: int = 1000,
    run_id: str = RUN_ID,
    signer: Identity | None = None,
) -> SignedReceipt:
    """A part receipt of ``aggregator`` for ``sender``'s parts of ``step`` (signed by ``signer``, by
    default the aggregator itself)."""
    return part_receipt(aggregator, sender.peer_id, step, weight, run_id, nbytes, T0, signer)


def part_receipt(
    aggregator: Identity,
    sender: str,
    step: int,
    weight: float,
    run_id: str,
    nbytes: int,
    issued_at: float,
    signer: Identity | None = None,
) -> SignedReceipt:
    """The one way tests build a signed part receipt (group ``g``, round 0)."""
    receipt = PartReceipt(
        run_id=run_id,
        aggregator=aggregator.peer_id,
        sender=sender,
        step=step,
        group_id=b"g",
        round=0,
        weight=weight,
        nbytes=nbytes,
        issued_at=issued_at,
    )
    return sign_receipt(receipt, (signer or aggregator).sign)


def sign(who: Identity, report: ContributionReport) -> SignedReport:
    data = msgspec.msgpack.encode(report)
    return SignedReport(report=data, signature=who.sign(report_payload(data)))
