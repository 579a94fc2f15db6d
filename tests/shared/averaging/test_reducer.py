"""The aggregator's slice reduction, round outcomes, and the gradient-part wire headers
(shared.averaging.reducer, protocols.averaging)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protocols.averaging import (
    AveragedHeader,
    PartHeader,
    decode_averaged_header,
    decode_part_header,
    encode_header,
)
from protocols.errors import ProtocolError
from protocols.peer_id import PeerId
from protocols.training import AveragingSpec
from shared.averaging.compression import codec_by_name
from shared.averaging.partition import SliceAssembly, make_slices, plan_parts, split_slice
from shared.averaging.reducer import (
    NothingToAverage,
    PartRejected,
    RejectReason,
    RoundOutcome,
    SliceReducer,
    apply_outcome,
)

A, B, C, Z = PeerId("peer-zeta"), PeerId("peer-alpha"), PeerId("peer-mid"), PeerId("peer-aux")
F32 = np.float32
#: The arithmetic tests below draw arbitrary vectors, not gradients of one group: the relative norm bound
#: (tested in test_robust.py) would rightly ban some of them.
NO_BOUND = AveragingSpec(norm_factor=math.inf)


def header(index: int, offset: int, numel: int, weight: float = 1.0) -> PartHeader:
    return PartHeader(
        group_id=b"group", round=3, part_index=index, offset=offset, numel=numel, codec="none", weight=weight,
        nbytes=4 * numel,
    )  # fmt: skip


def deliver(
    reducer: SliceReducer, sender: PeerId, x: np.ndarray, weight: float, parts: Sequence[int] = ()
) -> None:
    for index in parts or range(-(-x.size // reducer.part_numel)):
        start = index * reducer.part_numel
        chunk = x[start : start + reducer.part_numel]
        reducer.add_part(sender, header(index, start, chunk.size, weight), chunk)


def reduce_all(contributions: dict[PeerId, tuple[np.ndarray, float]], part_numel: int = 4) -> np.ndarray:
    numel = next(iter(contributions.values()))[0].size
    reducer = SliceReducer(
        numel, dict.fromkeys(contributions), max_norm=math.inf, part_numel=part_numel, rule=NO_BOUND
    )
    for peer, (x, weight) in contributions.items():
        deliver(reducer, peer, x, weight)
    return reducer.finalize()


values32 = st.floats(-1e6, 1e6, width=32)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_reducer_is_the_exact_weighted_mean_whatever_the_arrival_order(data: st.DataObject) -> None:
    peers = [A, B, C, Z][: data.draw(st.integers(1, 4))]
    numel, part_numel = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 16))
    weights = data.draw(st.lists(st.integers(0, 10_000), min_size=len(peers), max_size=len(peers)))
    weights[0] += 1
    xs = [data.draw(arrays(F32, numel, elements=values32)) for _ in peers]
    arrivals = [(p, k) for p in range(len(peers)) for k in range(-(-numel // part_numel))]

    def run(order: Sequence[tuple[int, int]]) -> np.ndarray:
        reducer = SliceReducer(
            numel, dict.fromkeys(peers), max_norm=1e12, part_numel=part_numel, rule=NO_BOUND
        )
        for p, k in order:
            chunk = xs[p][k * part_numel : (k + 1) * part_numel]
            reducer.add_part(peers[p], header(k, k * part_numel, chunk.size, float(weights[p])), chunk)
        assert reducer.missing() == set()
        return reducer.finalize()

    result = run(data.draw(st.permutations(arrivals)))
    assert result.dtype == F32
    assert result.tobytes() == run(arrivals).tobytes()
    stacked = np.stack(xs).astype(np.float64)
    exact = np.average(stacked, axis=0, weights=weights)
    scale = np.average(np.abs(stacked), axis=0, weights=weights)
    tolerance = np.spacing(np.abs(exact).astype(F32)).astype(np.float64) + 2.0**-45 * scale
    assert np.all(np.abs(result - exact) <= tolerance)


def _bad_parts() -> list[tuple[str, Callable[[], tuple[PartHeader, np.ndarray]], RejectReason]]:
    good = np.ones(2, dtype=F32)

    def forced(**fields: object) -> PartHeader:
        h = header(1, 4, 2, 2.0)
        for name, value in fields.items():
            msgspec.structs.force_setattr(h, name, value)  # what decoding would refuse, for defense in depth
        return h

    return [
        ("nan", lambda: (header(1, 4, 2, 2.0), np.array([1, np.nan], dtype=F32)), RejectReason.NON_FINITE),
        ("inf", lambda: (header(1, 4, 2, 2.0), np.array([-np.inf, 1], dtype=F32)), RejectReason.NON_FINITE),
        ("float64", lambda: (header(1, 4, 2, 2.0), good.astype(np.float64)), RejectReason.BAD_DTYPE),
        ("2-d", lambda: (header(1, 4, 2, 2.0), good.reshape(1, 2)), RejectReason.BAD_DTYPE),
        ("wrong numel", lambda: (header(1, 4, 3, 2.0), np.ones(3, dtype=F32)), RejectReason.BAD_PART),
        ("values vs header", lambda: (header(1, 4, 2, 2.0), np.ones(3, dtype=F32)), RejectReason.BAD_PART),
        ("wrong offset", lambda: (header(1, 3, 2, 2.0), good), RejectReason.BAD_PART),
        ("no such part", lambda: (header(2, 8, 2, 2.0), good), RejectReason.BAD_PART),
        ("duplicate", lambda: (header(0, 0, 4, 2.0), np.ones(4, dtype=F32)), RejectReason.DUPLICATE),
        ("weight changed", lambda: (header(1, 4, 2, 3.0), good), RejectReason.BAD_WEIGHT),
        ("negative weight", lambda: (forced(weight=-2.0), good), RejectReason.BAD_WEIGHT),
        ("nan weight", lambda: (forced(weight=math.nan), good), RejectReason.BAD_WEIGHT),
        (
            "absurd norm",
            lambda: (header(1, 4, 2, 2.0), np.full(2, 72.0, dtype=F32)),
            RejectReason.ABSURD_NORM,
        ),
        (
            "float32 overflow",
            lambda: (header(1, 4, 2, 2.0), np.full(2, 1e30, dtype=F32)),
            RejectReason.ABSURD_NORM,
        ),
        (
            "absurd element",
            lambda: (header(1, 4, 2, 2.0), np.array([0, 80], dtype=F32)),
            RejectReason.ABSURD_VALUE,
        ),
    ]


@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in _bad_parts()], ids=[c[0] for c in _bad_parts()])
def test_reducer_rejects_bad_part_bans_sender_and_forgets_its_earlier_parts(
    make: Callable[[], tuple[PartHeader, np.ndarray]], reason: RejectReason
) -> None:
    reducer = SliceReducer(6, {A: None, B: None}, max_norm=100.0, part_numel=4, max_abs=75.0)
    reducer.add_part(A, header(0, 0, 4, 2.0), np.full(4, 9.0, dtype=F32))  # a good part first
    bad_header, bad_values = make()
    with pytest.raises(PartRejected) as caught:
        reducer.add_part(A, bad_header, bad_values)
    assert caught.value.reason is reason and reason.bans and caught.value.sender == A
    with pytest.raises(PartRejected, match="banned") as again:
        reducer.add_part(A, header(1, 4, 2, 2.0), np.ones(2, dtype=F32))
    assert again.value.reason is RejectReason.BANNED
    b = np.array([1, 2, 3, 4, 5, 6], dtype=F32)
    deliver(reducer, B, b, 5.0)
    assert reducer.missing() == set()
    assert reducer.finalize().tobytes() == b.tobytes()  # nothing of A's good part 0 remains
    report = reducer.completeness()
    assert report.contributors == (B,) and report.banned == ((A, reason),) and report.total_weight == 5.0


def test_reducer_rejects_weight_other_than_announced() -> None:
    reducer = SliceReducer(2, {A: 5.0}, max_norm=10.0)
    with pytest.raises(PartRejected, match="weight"):
        reducer.add_part(A, header(0, 0, 2, 4.0), np.ones(2, dtype=F32))


def test_reducer_rejects_unknown_sender_without_changing_state() -> None:
    reducer = SliceReducer(2, {A: None}, max_norm=10.0)
    with pytest.raises(PartRejected) as caught:
        reducer.add_part(B, header(0, 0, 2), np.ones(2, dtype=F32))
    assert caught.value.reason is RejectReason.UNKNOWN_SENDER and not caught.value.reason.bans
    assert reducer.missing() == {A} and reducer.completeness().banned == ()


def test_reducer_drop_sender_renormalizes_over_the_rest() -> None:
    a, b, c = (np.arange(6, dtype=F32) * k for k in (1.5, -2.0, 3.25))
    reducer = SliceReducer(6, {A: None, B: None, C: None}, max_norm=1e3, part_numel=4)
    deliver(reducer, A, a, 7.0, parts=[0])
    assert reducer.missing() == {A, B, C}
    reducer.drop_sender(A, "connection reset")
    deliver(reducer, B, b, 2.0)
    deliver(reducer, C, c, 3.0)
    with pytest.raises(PartRejected) as caught:
        deliver(reducer, A, a, 7.0, parts=[1])
    assert caught.value.reason is RejectReason.DROPPED
    assert reducer.finalize().tobytes() == reduce_all({B: (b, 2.0), C: (c, 3.0)}).tobytes()
    assert reducer.completeness().dropped == (
        (A, "connection reset"),
    ) and reducer.completeness().contributors == (B, C)
    reducer.drop_sender(B)  # after finalize: the result is fixed, nothing changes
    assert reducer.completeness().dropped == ((A, "connection reset"),)
    with pytest.raises(ValueError, match="not a sender"):
        reducer.drop_sender(Z)


def test_reducer_finalize_excludes_incomplete_senders() -> None:
    a, b = np.full(6, 4.0, dtype=F32), np.arange(6, dtype=F32)
    reducer = SliceReducer(6, {A: None, B: None}, max_norm=1e3, part_numel=4)
    deliver(reducer, A, a, 1.0, parts=[1])
    deliver(reducer, B, b, 1.0)
    assert reducer.missing() == {A}
    assert reducer.finalize().tobytes() == b.tobytes()
    report = reducer.completeness()
    assert report.incomplete == (A,) and report.contributors == (B,) and not report.complete


@settings(max_examples=50, deadline=None)
@given(
    arrays(F32, 7, elements=values32), arrays(F32, 7, elements=values32), arrays(F32, 7, elements=values32)
)
def test_reducer_weight_zero_sender_changes_no_bit(a: np.ndarray, b: np.ndarray, aux: np.ndarray) -> None:
    with_aux = reduce_all({A: (a, 3.0), B: (b, 1.0), Z: (aux, 0.0)})
    assert with_aux.tobytes() == reduce_all({A: (a, 3.0), B: (b, 1.0)}).tobytes()


def test_reducer_with_no_weight_has_nothing_to_average() -> None:
    reducer = SliceReducer(3, {Z: 0.0, A: None}, max_norm=10.0)
    deliver(reducer, Z, np.ones(3, dtype=F32), 0.0)
    reducer.drop_sender(A)
    with pytest.raises(NothingToAverage) as caught:
        reducer.finalize()
    assert caught.value.completeness.contributors == (Z,) and caught.value.completeness.dropped == (
        (A, "unreachable"),
    )
    with pytest.raises(RuntimeError, match="already finalized"):
        reducer.finalize()
    with pytest.raises(PartRejected) as late:
        deliver(reducer, A, np.ones(3, dtype=F32), 1.0)
    assert late.value.reason is RejectReason.FINALIZED


def test_reducer_of_an_empty_slice_yields_an_empty_average() -> None:
    assert SliceReducer(0, {A: None}, max_norm=1.0).finalize().size == 0


@pytest.mark.parametrize(
    ("numel", "senders", "max_norm", "max_abs"),
    [
        (-1, {}, 1.0, None),
        (1, {}, 0.0, None),
        (1, {}, math.nan, None),
        (1, {}, 1.0, 0.0),
        (1, {A: -1.0}, 1.0, None),
    ],
)
def test_reducer_rejects_bad_configuration(
    numel: int, senders: dict[PeerId, float | None], max_norm: float, max_abs: float | None
) -> None:
    with pytest.raises(ValueError, match=r"must be|announced"):
        SliceReducer(numel, senders, max_norm, max_abs=max_abs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.data())
def test_apply_outcome_writes_averaged_slices_and_leaves_the_rest_untouched(
    sizes: list[int], data: st.DataObject
) -> None:
    slices = make_slices(sizes)
    failed = {i: "aggregator died" for i in data.draw(st.sets(st.sampled_from(range(len(sizes)))))}
    local = np.arange(sum(sizes), dtype=F32)
    before = local.copy()
    averaged = {s.aggregator_index: np.full(s.numel, -1.0 - s.aggregator_index, dtype=F32) for s in slices}
    outcome = RoundOutcome.of(slices, failed)
    ranges = apply_outcome(local, averaged, outcome)
    assert ranges == [(s.start, s.stop) for s in slices if s.aggregator_index in failed and s.numel]
    assert outcome.complete == (not ranges)
    for s in slices:
        expected = before[s.start : s.stop] if s.aggregator_index in failed else averaged[s.aggregator_index]
        assert local[s.start : s.stop].tobytes() == expected.tobytes()


@pytest.mark.parametrize("bad", [None, np.zeros(3, dtype=F32), np.zeros(4, dtype=np.float64)])
def test_apply_outcome_never_half_writes(bad: np.ndarray | None) -> None:
    slices = make_slices([2, 4])
    local = np.arange(6, dtype=F32)
    averaged = {0: np.zeros(2, dtype=F32)} | ({} if bad is None else {1: bad})
    with pytest.raises(ValueError, match="aggregator 1"):
        apply_outcome(local, averaged, RoundOutcome.of(slices, {}))
    assert local.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8-blockwise"])
def test_butterfly_round_on_the_pure_cores_leaves_peers_bit_identical(codec_name: str) -> None:
    """Three peers, three aggregators, part size 5; aggregator 2 dies before returning its slice."""
    codec, part_numel, peers = codec_by_name(codec_name), 5, [A, B, C]
    rng = np.random.default_rng(7)
    grads = {p: rng.standard_normal(23).astype(F32) for p in peers}
    weights = {A: 4.0, B: 1.0, C: 2.0}
    slices = make_slices([9, 0, 14])
    reducers = {
        s.aggregator_index: SliceReducer(s.numel, weights, 1e3, part_numel=part_numel) for s in slices
    }
    for peer in peers:
        for part in plan_parts(slices, part_numel):
            data = codec.encode(grads[peer][part.start : part.stop])
            h = PartHeader(
                group_id=b"g", round=0, part_index=part.part_index, offset=part.offset, numel=part.numel,
                codec=codec.name, weight=weights[peer], nbytes=len(data),
            )  # fmt: skip
            h = decode_part_header(encode_header(h))
            reducers[part.aggregator_index].add_part(peer, h, codec.decode(data, h.numel))
    returned = {}
    for s in slices[:2]:  # aggregator 2 died: its slice comes back to no one
        average = reducers[s.aggregator_index].finalize()
        assembly = SliceAssembly(s, part_numel)
        for part in split_slice(s, part_numel):
            chunk = average[part.offset : part.offset + part.numel]
            assembly.add(part.part_index, part.offset, codec.decode(codec.encode(chunk), part.numel))
        returned[s.aggregator_index] = assembly.values
    outcome = RoundOutcome.of(slices, {2: "aggregator unreachable"})
    for peer in peers:
        local = grads[peer].copy()
        assert apply_outcome(local, returned, outcome) == [(9, 23)]
        assert local[9:].tobytes() == grads[peer][9:].tobytes()
        assert local[:9].tobytes() == returned[0].tobytes()
    exact = sum(weights[p] * grads[p][:9].astype(np.float64) for p in peers) / sum(weights.values())
    tolerance = {"none": 1e-6, "fp16": 2e-3, "int8-blockwise": 0.05}[codec_name]
    assert np.allclose(returned[0], exact, atol=tolerance)


def test_part_header_round_trips_and_validates() -> None:
    h = header(2, 8, 4, 3.0)
    assert decode_part_header(encode_header(h)) == h
    with pytest.raises(ValueError, match="bytes"):
        PartHeader(
            group_id=b"g", round=0, part_index=0, offset=0, numel=4, codec="fp16", weight=1.0, nbytes=16
        )
    with pytest.raises(ValueError, match="weight"):
        header(0, 0, 1, math.inf)


@pytest.mark.parametrize(
    "change",
    [
        {"group_id": b"x" * 33},
        {"round": -1},
        {"weight": -1.0},
        {"weight": math.nan},
        {"weight": 2.0**60},
        {"nbytes": 15},
        {"codec": "int4"},
        {"dtype": "float64"},
        {"numel": -1},
        {"surprise": 1},
    ],
    ids=str,
)
def test_part_header_decode_rejects_bad_fields(change: dict[str, object]) -> None:
    fields = msgspec.structs.asdict(header(0, 0, 4))
    with pytest.raises(ProtocolError, match="invalid part header"):
        decode_part_header(msgspec.msgpack.encode(fields | change))


def test_averaged_header_round_trips_and_validates() -> None:
    h = AveragedHeader(
        group_id=b"g", round=1, part_index=0, offset=0, numel=4097, codec="int8-blockwise", nbytes=4105,
        total_weight=7.0, contributors=3, digest=b"d" * 32, signature=b"s" * 64,
    )  # fmt: skip
    assert decode_averaged_header(encode_header(h)) == h
    fields = msgspec.structs.asdict(h)
    for change in (
        {"total_weight": math.inf},
        {"contributors": -1},
        {"nbytes": 4104},
        {"digest": b"d" * 31},
        {"signature": b"s" * 63},
    ):
        with pytest.raises(ProtocolError, match="invalid averaged header"):
            decode_averaged_header(msgspec.msgpack.encode(fields | change))
    with pytest.raises(ProtocolError):
        decode_averaged_header(b"\xc1")
