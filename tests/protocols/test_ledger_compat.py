"""Wire compatibility of contribution reports: a report without discarded steps decodes on a backbone of
the version before the field existed (its decoder forbids unknown fields), and one with them is refused
there (the volunteer gives it up and a later report carries its receipts)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest

from protocols.ledger import ContributionReport, StepRange
from protocols.receipts import PulledSlice, SignedReceipt
from shared.auth.keys import Identity


class OldReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """ContributionReport as commit b253b6f defined it."""

    run_id: str
    peer_id: str
    seq: int
    global_step: int
    samples: int
    compute_seconds: float
    bytes_aggregated: int
    bytes_relayed: int
    interval_start: float
    interval_end: float
    receipts: Annotated[list[SignedReceipt], msgspec.Meta(max_length=32)] = []
    pulled: Annotated[list[PulledSlice], msgspec.Meta(max_length=32)] = []


def report(**fields: object) -> ContributionReport:
    return ContributionReport(
        run_id="r@x",
        peer_id=Identity.generate().peer_id,
        seq=3,
        global_step=7,
        samples=64,
        compute_seconds=1.0,
        bytes_aggregated=0,
        bytes_relayed=0,
        interval_start=1.0,
        interval_end=2.0,
        **fields,  # type: ignore[arg-type]
    )


def test_a_report_without_discards_decodes_on_the_previous_version() -> None:
    new = report(pulled=[PulledSlice(Identity.generate().peer_id, 7, 10)])
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldReport)
    assert (old.seq, old.samples, old.pulled, old.receipts) == (3, 64, new.pulled, [])


def test_a_report_with_discards_is_refused_by_the_previous_version_and_read_by_this_one() -> None:
    new = report(discarded=[StepRange(4, 6)])
    data = msgspec.msgpack.encode(new)
    with pytest.raises(msgspec.ValidationError, match="discarded"):
        msgspec.msgpack.decode(data, type=OldReport)
    assert msgspec.msgpack.decode(data, type=ContributionReport) == new


def test_a_step_range_is_ordered() -> None:
    with pytest.raises(ValueError, match="last"):
        StepRange(5, 4)


class OldCapabilities(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Capabilities before issue 12 added the precision and the accelerator's memory."""

    samples_per_second: float
    upload_bps: float
    download_bps: float
    device: str


def test_a_cpu_peers_capabilities_decode_on_the_previous_version_and_an_accelerators_are_read_here() -> None:
    from protocols.ledger import Capabilities

    cpu = Capabilities(samples_per_second=5.0, upload_bps=1.0, download_bps=2.0, device="CPU: x, 2 cores")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cpu), type=OldCapabilities).device == cpu.device
    gpu = msgspec.structs.replace(cpu, device="NVIDIA T4, 15 GiB", precision="fp16", memory_bytes=15 * 2**30)
    data = msgspec.msgpack.encode(gpu)
    assert msgspec.msgpack.decode(data, type=Capabilities) == gpu
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(data, type=OldCapabilities)
    with pytest.raises(ValueError, match="memory_bytes"):
        msgspec.structs.replace(cpu, memory_bytes=-1)


def test_a_report_without_relayed_bytes_decodes_on_the_previous_version_and_one_with_them_is_refused() -> (
    None
):
    from protocols.ledger import RelayedBytes

    plain = msgspec.msgpack.encode(report())
    assert msgspec.msgpack.decode(plain, type=OldReport).seq == 3  # omitted when empty
    new = report(relayed_through=[RelayedBytes(Identity.generate().peer_id, 12345)])
    data = msgspec.msgpack.encode(new)
    with pytest.raises(msgspec.ValidationError, match="relayed_through"):
        msgspec.msgpack.decode(data, type=OldReport)
    assert msgspec.msgpack.decode(data, type=ContributionReport) == new


def _raw_report(relayed: object) -> bytes:
    fields = msgspec.structs.asdict(report())
    fields["relayed_through"] = relayed
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("relayed", "match"),
    [
        ([["not-a-peer-id", 1]], "relayed_through"),
        ([[None, 1]], "relayed_through"),
        ([["R", -1]], "relayed_through"),
        ([["R", 2**53 + 1]], "relayed_through"),
        ([["R", 1.5]], "relayed_through"),
        ([["R", 1, 2]], "relayed_through"),
        ([["R"]], "relayed_through"),
        ([["R", 1]] * 17, "relayed_through"),
        ([["R", 1], ["R", 2]], "at most once"),
        ("R", "relayed_through"),
    ],
)
def test_malformed_relayed_bytes_are_refused_when_decoding(relayed: object, match: str) -> None:
    relay = Identity.generate().peer_id

    def fill(value: object) -> object:
        if isinstance(value, list):
            return [fill(v) for v in value]
        return relay if value == "R" else value

    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.msgpack.decode(_raw_report(fill(relayed)), type=ContributionReport)


def test_relayed_bytes_are_bounded_on_construction_too() -> None:
    from protocols.ledger import MAX_RELAYED_PER_REPORT, RelayedBytes

    relays = [Identity.generate().peer_id for _ in range(MAX_RELAYED_PER_REPORT + 1)]
    with pytest.raises(ValueError, match="nbytes"):
        RelayedBytes(relays[0], 2**53 + 1)
    with pytest.raises(ValueError, match="at most"):
        report(relayed_through=[RelayedBytes(r, 1) for r in relays])
    with pytest.raises(ValueError, match="at most once"):
        report(relayed_through=[RelayedBytes(relays[0], 1), RelayedBytes(relays[0], 2)])
    full = report(relayed_through=[RelayedBytes(r, 2**53) for r in relays[:-1]])
    assert len(msgspec.msgpack.encode(full)) < 2048  # 16 relays: well inside MAX_REPORT_BYTES' room


class ReportBeforeStageDiscards(OldReport, frozen=True, forbid_unknown_fields=True):
    """ContributionReport as the version before ``stage_discarded`` defined it (schema 11's backbones)."""

    discarded: list[StepRange] = []
    relayed_through: list[object] = []
    bytes_sent: int = 0
    received_from: list[object] = []


def test_a_report_without_stage_discards_decodes_on_the_previous_version_and_one_with_them_is_refused() -> (
    None
):
    from protocols.ledger import ReceivedBytes, StageStepRange

    plain = report(discarded=[StepRange(4, 6)], received_from=[ReceivedBytes(Identity.generate().peer_id, 9)])
    data = msgspec.msgpack.encode(plain)
    old = msgspec.msgpack.decode(data, type=ReportBeforeStageDiscards)
    assert (old.discarded, old.seq) == ([StepRange(4, 6)], 3)  # a data-parallel discard's bytes unchanged
    new = report(stage_discarded=[StageStepRange(2, 5, 9)])
    data = msgspec.msgpack.encode(new)
    with pytest.raises(msgspec.ValidationError, match="stage_discarded"):
        msgspec.msgpack.decode(data, type=ReportBeforeStageDiscards)
    assert msgspec.msgpack.decode(data, type=ContributionReport) == new
    assert msgspec.msgpack.encode(StageStepRange(2, 5, 9)) == msgspec.msgpack.encode([2, 5, 9])
    with pytest.raises(ValueError, match="last"):
        StageStepRange(0, 5, 4)
