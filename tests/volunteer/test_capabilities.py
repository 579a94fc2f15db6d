"""Measured capabilities: the device string, throughput timing, drift, and measuring + publishing against
a real backbone-like node (volunteer.capabilities)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import time
from pathlib import Path

import msgspec
import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.ledger import Capabilities
from protocols.probe import CAPABILITIES_KEY, decode_capability_record
from shared.auth.keys import Identity
from shared.errors import ConfigError, RecordRejected
from shared.net.host import HostConfig
from shared.net.probe import ProbeService
from shared.net.reachability import Reachability
from shared.node import Node, open_node
from volunteer.capabilities import (
    DriftTracker,
    MeasuredCapabilities,
    choose_device,
    device_description,
    measure_capabilities,
    measure_samples_per_second,
    publish_capabilities,
    resolve_device,
    with_reachability,
)
from volunteer.policy import bandwidth_caps

RUN_ID = "caps-test"
HANG_GUARD_S = 20
MiB = 1 << 20

# ---------------------------------------------------------------- device


def test_device_description_names_the_device_and_fits_the_wire_limit() -> None:
    text = device_description()
    assert 0 < len(text) <= 128
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in text and text.endswith("GiB")
    else:
        assert text.startswith("CPU: ") and text.endswith(f", {os.cpu_count()} cores")
    Capabilities(samples_per_second=1.0, upload_bps=1.0, download_bps=1.0, device=text)  # valid on the wire


def test_device_description_describes_the_chosen_device_not_the_machines_first_gpu() -> None:
    assert device_description("cpu").startswith("CPU: ")
    if torch.cuda.is_available():
        last = torch.cuda.device_count() - 1
        assert torch.cuda.get_device_name(last) in device_description(f"cuda:{last}")


@pytest.mark.parametrize(
    ("choice", "cuda", "mps", "device"),
    [
        ("auto", 0, False, "cpu"),
        ("auto", 2, False, "cuda:0"),
        ("auto", 0, True, "mps"),  # issue 12: CUDA, then MPS, then the CPU
        ("auto", 1, True, "cuda:0"),
        ("cpu", 4, False, "cpu"),
        (" CUDA ", 1, False, "cuda:0"),
        ("cuda:1", 2, False, "cuda:1"),
        ("mps", 0, True, "mps"),
    ],
)
def test_resolve_device_picks_what_the_machine_has(choice: str, cuda: int, mps: bool, device: str) -> None:
    assert resolve_device(choice, cuda, mps) == device


@pytest.mark.parametrize(
    ("choice", "cuda", "message"),
    [
        ("cuda", 0, "--device cuda: torch sees no CUDA device on this machine"),
        ("cuda:0", 0, "use --device cpu or auto"),
        ("cuda:7", 1, "--device cuda:7: this machine has 1 CUDA device (cuda:0); pick one of them, or auto"),
        ("cuda:2", 2, "this machine has 2 CUDA devices (cuda:0 to cuda:1)"),
        ("tpu", 8, "--device 'tpu' is not a device to train on: use auto, cpu, cuda, cuda:N or mps"),
        ("cuda:-1", 8, "a CUDA device is cuda or cuda:N"),
        ("cuda:x", 8, "a CUDA device is cuda or cuda:N"),
        ("mps", 8, "torch sees no Apple GPU (MPS)"),
        ("", 8, "is not a device to train on"),
    ],
)
def test_resolve_device_refuses_what_the_machine_lacks_in_one_line(
    choice: str, cuda: int, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_device(choice, cuda)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--threads", "100000"), f"--threads 100000: give 1 to {os.cpu_count()} (this machine's CPUs)"),
        (("--manifest", "{tmp}/run.toml"), "{tmp}/run.toml: unknown task 'gpt-5': volunteers can train"),
    ],
)
def test_join_refuses_bad_input_before_the_data_dir_the_invite_or_the_network(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    from typer.testing import CliRunner

    from volunteer.cli import app

    (tmp_path / "run.toml").write_text('task = "gpt-5"\n')
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        argv = ["join", "r", "--initial-peer", "/ip4/127.0.0.1/tcp/5", "--data-dir", str(tmp_path / "v")]
        result = CliRunner().invoke(app, [*argv, "--no-panel", *(e.format(tmp=tmp_path) for e in extra)])
    finally:  # the command set up logging for its process: give the test process's back
        root.handlers[:] = handlers
        root.setLevel(level)
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith(f"error: {message.format(tmp=tmp_path)}")
    assert not (tmp_path / "v").exists()


def test_choose_device_asks_the_real_torch() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert choose_device("auto") == ("cuda:0" if count else "cpu")
    assert choose_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="CUDA device"):
        choose_device(f"cuda:{count}")  # one past the last (on a CPU machine: cuda:0, which it lacks)


# ---------------------------------------------------------------- throughput


def test_measure_samples_per_second_times_a_real_training_step_after_its_warm_up() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    data, target = torch.randn(16, 32), torch.randint(0, 4, (16,))
    calls: list[float] = []
    readings: list[float] = []
    progress: list[float] = []

    def step() -> int:
        calls.append(time.perf_counter())
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        return len(data)

    def clock() -> float:
        readings.append(time.perf_counter())
        return readings[-1]

    rate = measure_samples_per_second(
        step, warmup_steps=3, seconds=0.2, on_progress=progress.append, clock=clock
    )

    timed = len(calls) - 3
    assert timed >= 1 and len(progress) == timed
    assert all(calls[i] < readings[0] for i in range(3))  # the warm-up ran before the clock started
    assert progress == sorted(progress) and progress[-1] == 1.0 and all(0 < p <= 1 for p in progress)
    assert rate == pytest.approx(16 * timed / (readings[-1] - readings[0]))
    assert readings[-1] - readings[0] >= 0.2
    assert model[0].weight.grad is not None  # the steps really ran backward


#: durations in 1/1024 s: sums of these are exact in floating point, so the assertions can be too
ticks = st.integers(1, 100_000).map(lambda k: k / 1024)


@given(
    warmup=st.lists(st.tuples(st.integers(0, 1000), ticks), max_size=5),
    timed=st.lists(st.tuples(st.integers(0, 1000), ticks), min_size=1, max_size=20),
    seconds=ticks,
)
def test_measure_samples_per_second_counts_only_steps_after_warm_up(
    warmup: list[tuple[int, float]], timed: list[tuple[int, float]], seconds: float
) -> None:
    # A virtual clock that each step advances by its duration: warm-up steps never count, however slow.
    now = [0.0]
    plan = itertools.chain(warmup, timed, itertools.repeat((1, 1.0)))
    done: list[tuple[int, float]] = []

    def step() -> int:
        samples, duration = next(plan)
        now[0] += duration
        done.append((samples, duration))
        return samples

    rate = measure_samples_per_second(step, warmup_steps=len(warmup), seconds=seconds, clock=lambda: now[0])

    measured = done[len(warmup) :]
    elapsed = sum(d for _, d in measured)
    assert elapsed >= seconds and elapsed - measured[-1][1] < seconds  # stops at the first step past it
    assert rate == pytest.approx(sum(n for n, _ in measured) / elapsed)


@pytest.mark.parametrize("bad", [-1, True, 1.5, None])
def test_measure_samples_per_second_rejects_a_step_that_does_not_return_a_sample_count(bad: object) -> None:
    with pytest.raises(ValueError, match="samples"):
        measure_samples_per_second(lambda: bad, warmup_steps=0, seconds=0.01)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(("warmup", "seconds"), [(-1, 1.0), (0, 0.0), (0, math.nan), (0, math.inf)])
def test_measure_samples_per_second_rejects_bad_arguments(warmup: int, seconds: float) -> None:
    with pytest.raises(ValueError, match=r"warmup_steps|seconds"):
        measure_samples_per_second(lambda: 1, warmup_steps=warmup, seconds=seconds)


# ---------------------------------------------------------------- drift

rates = st.floats(0.0, 1e12)
positive_rates = st.floats(1e-3, 1e12)
thresholds = st.floats(0.01, 0.9)


def caps(sps: float = 100.0, up: float = 1e6, down: float = 1e6, device: str = "cpu") -> Capabilities:
    return Capabilities(samples_per_second=sps, upload_bps=up, download_bps=down, device=device)


@given(rate=rates, threshold=thresholds)
def test_drift_tracker_publishes_the_first_value_and_not_the_same_one_again(
    rate: float, threshold: float
) -> None:
    tracker = DriftTracker(threshold)
    assert tracker.update(rate) is True
    assert tracker.update(rate) is False
    assert tracker.published == rate


@given(rate=positive_rates, threshold=thresholds, within=st.floats(-0.99, 0.99))
def test_drift_tracker_ignores_changes_within_the_threshold(
    rate: float, threshold: float, within: float
) -> None:
    tracker = DriftTracker(threshold)
    tracker.update(rate)
    assert tracker.update(rate * (1 + within * threshold)) is False
    assert tracker.published == rate  # still the published value


@given(rate=positive_rates, threshold=thresholds, beyond=st.floats(1.01, 5.0), up=st.booleans())
def test_drift_tracker_republishes_changes_beyond_the_threshold(
    rate: float, threshold: float, beyond: float, up: bool
) -> None:
    tracker = DriftTracker(threshold)
    tracker.update(rate)
    factor = 1 + beyond * threshold if up else max(0.0, 1 - beyond * threshold)
    assert tracker.update(rate * factor) is True
    assert tracker.published == rate * factor


@given(rate=positive_rates, threshold=thresholds)
def test_drift_tracker_catches_a_slow_creep_against_the_published_value(
    rate: float, threshold: float
) -> None:
    # Each step moves only a third of the threshold, yet the third step is beyond it from the published value.
    tracker = DriftTracker(threshold)
    tracker.update(rate)
    answers = [tracker.update(rate * (1 + threshold / 3) ** k) for k in (1, 2, 3)]
    assert answers == [False, False, True]


@given(
    sps=positive_rates, up=positive_rates, down=positive_rates, which=st.integers(0, 2), threshold=thresholds
)
def test_drift_tracker_watches_every_rate_of_the_capabilities(
    sps: float, up: float, down: float, which: int, threshold: float
) -> None:
    tracker = DriftTracker(threshold)
    tracker.update(caps(sps, up, down))
    moved = [sps, up, down]
    moved[which] *= 1 + 2 * threshold
    assert tracker.update(caps(*moved)) is True


def test_drift_tracker_republishes_on_any_change_of_device_or_reachability() -> None:
    tracker = DriftTracker()
    reachable = MeasuredCapabilities(caps(), ("/ip4/203.0.113.7/tcp/4001",))
    assert tracker.update(reachable) is True
    assert tracker.update(MeasuredCapabilities(caps(), ("/ip4/203.0.113.7/tcp/4001",), 5.0)) is False
    assert tracker.update(MeasuredCapabilities(caps(), ())) is True  # became client mode
    assert tracker.update(MeasuredCapabilities(caps(device="other"), ())) is True
    assert tracker.update(caps(device="other")) is True  # another kind of value


def test_drift_tracker_from_zero_drifts_to_anything_positive() -> None:
    tracker = DriftTracker()
    tracker.update(0.0)
    assert tracker.update(0.0) is False
    assert tracker.update(1e-9) is True


@pytest.mark.parametrize("threshold", [0.0, -0.1, math.nan, math.inf])
def test_drift_tracker_rejects_a_threshold_that_is_not_positive_and_finite(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold"):
        DriftTracker(threshold)


@pytest.mark.parametrize("rate", [-1.0, math.nan, math.inf])
def test_drift_tracker_rejects_impossible_rates(rate: float) -> None:
    with pytest.raises(ValueError, match="rates"):
        DriftTracker().update(rate)


# ---------------------------------------------------------------- measuring and publishing


async def _nodes(
    nursery: trio.Nursery, client_mode: bool = False, volunteer_config: HostConfig | None = None
) -> tuple[Node, Node, ProbeService]:
    async def run(
        listen: list[str],
        initial: list[str],
        config: HostConfig | None,
        task_status: trio.TaskStatus[Node],
    ) -> None:
        async with open_node(
            Identity.generate(), RUN_ID, "volunteer", listen=listen, initial_peers=initial, host_config=config
        ) as n:
            task_status.started(n)
            await trio.sleep_forever()

    backbone: Node = await nursery.start(run, ["/ip4/127.0.0.1/tcp/0"], [], None)
    probes = ProbeService(backbone.host)
    listen = [] if client_mode else ["/ip4/127.0.0.1/tcp/0"]
    volunteer: Node = await nursery.start(run, listen, [backbone.host.listen_addrs[0]], volunteer_config)
    return backbone, volunteer, probes


async def test_measure_capabilities_against_a_probe_server_and_publish_them_in_the_dht(
    nursery: trio.Nursery,
) -> None:
    backbone, volunteer, probes = await _nodes(nursery)
    with trio.fail_after(HANG_GUARD_S):
        measured = await measure_capabilities(
            volunteer.host, backbone.host.listen_addrs[0], 123.5, probe_bytes=MiB
        )
        stored = await publish_capabilities(volunteer.dht, measured)
        found = await backbone.dht.get(CAPABILITIES_KEY, latest=True)

    assert measured.capabilities.samples_per_second == 123.5
    assert measured.capabilities.upload_bps > 0 and measured.capabilities.download_bps > 0
    assert measured.capabilities.device == device_description()
    assert measured.reachable == tuple(volunteer.host.listen_addrs) and not measured.client_mode
    assert abs(measured.measured_at - time.time()) < 60
    assert probes.statistics().bytes_sent == MiB
    assert stored >= 1
    assert found is not None
    record = decode_capability_record(found.entries[volunteer.peer_id.encode()].value)
    assert record == measured.record()
    assert record.reachable == list(measured.reachable) and record.client_mode is False


async def test_published_capabilities_state_at_most_the_volunteers_bandwidth_caps(
    nursery: trio.Nursery,
) -> None:
    """``--max-upload 3 --max-download 5`` (volunteer.policy.bandwidth_caps): loopback measures far more,
    and a burst would inflate a short probe; what the load balancer reads is the cap."""
    up_cap, down_cap = bandwidth_caps(3.0, 5.0)
    config = HostConfig(max_upload_bps=up_cap, max_download_bps=down_cap)
    backbone, volunteer, _ = await _nodes(nursery, volunteer_config=config)
    with trio.fail_after(HANG_GUARD_S):
        measured = await measure_capabilities(
            volunteer.host, backbone.host.listen_addrs[0], 10.0, probe_bytes=MiB
        )
        await publish_capabilities(volunteer.dht, measured)
        found = await backbone.dht.get(CAPABILITIES_KEY, latest=True)

    assert up_cap is not None and down_cap is not None
    assert 0 < measured.capabilities.upload_bps <= up_cap
    assert 0 < measured.capabilities.download_bps <= down_cap
    assert found is not None
    record = decode_capability_record(found.entries[volunteer.peer_id.encode()].value)
    assert record == measured.record()
    assert 0 < record.capabilities.upload_bps <= up_cap and 0 < record.capabilities.download_bps <= down_cap


async def test_measure_capabilities_of_a_client_mode_peer(nursery: trio.Nursery) -> None:
    backbone, volunteer, _ = await _nodes(nursery, client_mode=True)
    with trio.fail_after(HANG_GUARD_S):
        measured = await measure_capabilities(
            volunteer.host, backbone.host.listen_addrs[0], 0.0, probe_bytes=MiB
        )

    assert measured.client_mode and measured.reachable == ()
    assert measured.capabilities.download_bps > 0  # downloaded over the connection it opened
    assert measured.record().client_mode is True


async def test_capability_records_are_written_only_by_the_peer_they_describe(nursery: trio.Nursery) -> None:
    backbone, volunteer, _ = await _nodes(nursery)
    value = msgspec.msgpack.encode(MeasuredCapabilities(caps()).record())
    with pytest.raises(RecordRejected):
        await volunteer.dht.store(CAPABILITIES_KEY, value, time.time() + 60, subkey=backbone.peer_id.encode())


async def test_measure_capabilities_rejects_an_impossible_throughput(nursery: trio.Nursery) -> None:
    backbone, volunteer, _ = await _nodes(nursery)
    with pytest.raises(ValueError, match="throughput"):
        await measure_capabilities(volunteer.host, backbone.host.listen_addrs[0], -1.0)


def test_the_cpu_trains_in_fp32_by_default_reports_no_accelerator_memory_and_may_ask_for_bf16() -> None:
    from volunteer.capabilities import choose_precision, device_memory

    assert choose_precision("auto", "cpu") == "fp32"
    assert choose_precision("bf16", "cpu") == "bf16"
    assert device_memory("cpu") == 0


def test_a_new_precision_or_memory_is_republished() -> None:
    tracker = DriftTracker()
    assert tracker.update(caps()) is True
    assert tracker.update(msgspec.structs.replace(caps(), precision="bf16")) is True
    assert tracker.update(msgspec.structs.replace(caps(), precision="bf16", memory_bytes=2**34)) is True
    assert tracker.update(msgspec.structs.replace(caps(), precision="bf16", memory_bytes=2**34)) is False


def test_a_relay_slot_gained_or_lost_is_republished_with_the_new_mode() -> None:
    """Issue 14 items 1 and 7: the record says how peers reach us now, not what they did when measured."""
    caps = Capabilities(samples_per_second=10.0, upload_bps=1e6, download_bps=1e6, device="cpu")
    client = Reachability(observed="203.0.113.9", checked_with="/ip4/198.51.100.1/tcp/4001")
    published = MeasuredCapabilities(caps, measured_at=1.0, observed="203.0.113.9", connectivity=client.mode)
    assert client.mode == "client" and with_reachability(published, client, now=2.0) is None  # unchanged
    circuit = "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooWrelay/p2p-circuit"
    relayed = dataclasses.replace(client, relayed=(circuit,))
    moved = with_reachability(published, relayed, now=2.0)
    assert moved is not None and (moved.connectivity, moved.measured_at) == ("relayed", 2.0)
    assert moved.capabilities == caps and moved.record().connectivity == "relayed"
    assert with_reachability(moved, relayed, now=3.0) is None  # published: nothing more to say
    back = with_reachability(moved, client, now=4.0)  # the relay died
    assert back is not None and back.connectivity == "client"
    direct = Reachability(reachable=("/ip4/203.0.113.9/tcp/4001",), observed="203.0.113.9")
    seen = with_reachability(published, direct, now=5.0)
    assert seen is not None and seen.connectivity == "direct" and not seen.client_mode
