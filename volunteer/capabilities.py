"""What this machine can do, measured rather than declared (DESIGN §1, §2).

The adaptive-averaging LP plans with each peer's samples/s on the run's model, upload and download
bandwidth, and whether it accepts connections. A volunteer measures them when it joins:

* the device: the CUDA device's name and memory, or the CPU model and core count (:func:`device_description`,
  :func:`device_memory`), of the device ``--device`` chose (:func:`choose_device`; :func:`resolve_device` is
  the pure rule -- ``auto`` is CUDA, else Apple's MPS, else the CPU -- and a device torch does not see is
  refused with one line before anything starts), and the precision training runs in there
  (:func:`choose_precision`, the rule in :mod:`volunteer.precision`);
* throughput: real training steps of the run's model, timed after a warm-up
  (:func:`measure_samples_per_second`, plain blocking code for a worker thread);
* bandwidth and reachability: probes against a backbone (:func:`measure_capabilities`, see
  :mod:`shared.net.probe`).

It publishes them (:func:`publish_capabilities`) in the DHT under :data:`protocols.probe.CAPABILITIES_KEY`
(for group leaders planning a round) and, signed, to the ledger through the backbone API (the ledger checks
contribution reports against them). Conditions change — a shared GPU, a busy home link — so the numbers are
re-measured now and then and republished when :class:`DriftTracker` says they moved enough to matter.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import trio

from protocols.ledger import Capabilities
from protocols.probe import CAPABILITIES_KEY, CAPABILITIES_TTL, MAX_REACH_ADDRS, CapabilityRecord
from shared.dht.node import DHTNode
from shared.errors import ConfigError
from shared.net.addresses import PeerAddress
from shared.net.host import Host
from shared.net.probe import check_reachable, measure_bandwidth
from shared.net.reachability import Reachability

from .api_client import ApiClient
from .precision import Precision, resolve_precision

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "DriftTracker",
    "MeasuredCapabilities",
    "choose_device",
    "choose_precision",
    "device_description",
    "device_memory",
    "measure_capabilities",
    "measure_samples_per_second",
    "parse_device",
    "publish_capabilities",
    "resolve_device",
]

#: Bytes moved each way by the bandwidth probe: ~0.7 s at 100 Mbit/s, far more than a round trip.
DEFAULT_PROBE_BYTES = 8 * 1024 * 1024
MAX_DEVICE_CHARS = 128
#: Measured rates are clamped below the wire ceiling (1e13 B/s); loopback can time absurdly fast.
_RATE_CEILING = 1e12


def parse_device(choice: str) -> tuple[str, int | None]:
    """``--device`` as (kind, CUDA index): ``("auto", None)``, ``("cpu", None)``, ``("mps", None)``,
    ``("cuda", N)`` (``cuda`` alone is device 0). Pure syntax: whether the machine has it is
    :func:`resolve_device`'s question.

    Raises:
        ConfigError: the choice is no device volunteers train on.
    """
    text = choice.strip().lower()
    if text in ("auto", "cpu", "mps"):
        return text, None
    kind, sep, index = text.partition(":")
    if kind != "cuda":
        raise ConfigError(
            f"--device {choice!r} is not a device to train on: use auto, cpu, cuda, cuda:N or mps"
        )
    if sep and not (index.isascii() and index.isdigit()):
        raise ConfigError(f"--device {choice!r}: a CUDA device is cuda or cuda:N, N its number (cuda:1)")
    return "cuda", int(index) if sep else 0


def resolve_device(choice: str, cuda_devices: int, mps: bool = False) -> str:
    """The torch device ``--device choice`` means on a machine where torch sees ``cuda_devices`` CUDA devices
    (and Apple's MPS if ``mps``): ``auto`` is ``cuda:0`` when there is one, else ``mps`` when there is
    one, else ``cpu``; ``cuda`` is ``cuda:0``; ``cuda:N``, ``cpu`` and ``mps`` are themselves, if the
    machine has them.

    Raises:
        ConfigError: the choice is no device volunteers train on, or this machine does not have it; the
            message says what it has and what to pass instead.
    """
    kind, number = parse_device(choice)
    if kind == "auto":
        return "cuda:0" if cuda_devices > 0 else "mps" if mps else "cpu"
    if kind == "cpu":
        return "cpu"
    if kind == "mps":
        if not mps:
            raise ConfigError("--device mps: torch sees no Apple GPU (MPS) on this machine; use --device cpu")
        return "mps"
    assert number is not None  # parse_device gives every cuda device its index
    if cuda_devices <= 0:
        raise ConfigError(
            f"--device {choice}: torch sees no CUDA device on this machine (no GPU, a CPU-only torch, or "
            "CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto"
        )
    if number >= cuda_devices:
        have = "1 CUDA device (cuda:0)"
        if cuda_devices > 1:
            have = f"{cuda_devices} CUDA devices (cuda:0 to cuda:{cuda_devices - 1})"
        raise ConfigError(f"--device {choice}: this machine has {have}; pick one of them, or auto")
    return f"cuda:{number}"


def choose_device(choice: str) -> str:
    """:func:`resolve_device` with what torch reports about this machine. Imports torch unless the choice
    is ``cpu`` or malformed (call it in a thread: that takes seconds).

    Raises:
        ConfigError: see :func:`resolve_device`.
    """
    if parse_device(choice)[0] == "cpu":
        return "cpu"
    import torch  # here, not at import time: loading torch takes seconds

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = bool(torch.backends.mps.is_available())
    return resolve_device(choice, cuda, mps)


def choose_precision(choice: str, device: str) -> Precision:
    """:func:`~volunteer.precision.resolve_precision` for ``device`` (a :func:`choose_device` result) with
    what torch reports about it: whether a CUDA device computes in bf16 natively (compute capability 8.0,
    Ampere, and later; ``torch.cuda.is_bf16_supported()`` also says yes where bf16 is only emulated, on a
    T4, which would be slower than fp16). Imports torch for CUDA.

    Raises:
        ConfigError: an unknown choice, or a precision ``device`` cannot autocast to.
    """
    bf16 = False
    if device.startswith("cuda"):
        import torch  # here, not at import time: loading torch takes seconds

        bf16 = torch.cuda.get_device_capability(device)[0] >= 8
    return resolve_precision(choice, device, bf16)


def device_memory(device: str) -> int:
    """Bytes of memory of ``device``'s accelerator: a CUDA device's total, the memory MPS recommends at
    most; 0 for the CPU."""
    if device.startswith("cuda"):
        import torch  # here, not at import time: loading torch takes seconds

        return int(torch.cuda.get_device_properties(int(device.partition(":")[2] or 0)).total_memory)
    if device == "mps":
        import torch

        return int(torch.mps.recommended_max_memory())
    return 0


def device_description(device: str = "auto") -> str:
    """A short description of ``device`` (a :func:`resolve_device` result; ``auto``: every CUDA device, else
    the CPU), at most 128 characters.

    ``"NVIDIA H100 80GB HBM3, 79.1 GiB"`` (``"2 x …"`` for several with ``auto``) for a CUDA device, else
    the CPU model from ``/proc/cpuinfo`` (or :mod:`platform`) and the core count:
    ``"CPU: AMD EPYC 7B13, 16 cores"``.
    """
    import torch  # here, not at import time: loading torch takes seconds

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        index = int(device.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        text = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        text = f"{count} x {text}" if count > 1 and device == "auto" else text
    elif device == "mps":
        text = f"Apple GPU (MPS), {platform.machine()}"
    else:
        text = f"CPU: {_cpu_model()}, {os.cpu_count() or 1} cores"
    return text[:MAX_DEVICE_CHARS]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return " ".join(value.split())
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine() or "unknown"


def measure_samples_per_second(
    step: Callable[[], int],
    *,
    warmup_steps: int,
    seconds: float,
    on_progress: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Time ``step`` and return the samples it processes per second.

    Blocking: run it in a worker thread. ``step`` does one unit of real work (a forward and backward pass
    of the run's model on a batch) and returns how many samples it processed; it must finish its work
    before returning (on a GPU, synchronise). The first ``warmup_steps`` calls are not timed (allocator,
    kernel selection and caches settle there); then steps run until ``seconds`` have passed — at least one.

    Args:
        on_progress: called after each timed step with the fraction of ``seconds`` elapsed (0..1].
        clock: a monotonic clock in seconds.

    Raises:
        ValueError: ``warmup_steps`` < 0, ``seconds`` not a positive finite number, or ``step`` returned
            something other than a non-negative int.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
    for _ in range(warmup_steps):
        _samples(step())
    started = clock()
    total = 0
    while True:
        total += _samples(step())
        elapsed = clock() - started
        if on_progress is not None:
            on_progress(min(1.0, elapsed / seconds))
        if elapsed >= seconds:
            return total / elapsed


def _samples(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a step must return the samples it processed (an int >= 0), got {value!r}")
    return value


@dataclass(frozen=True)
class MeasuredCapabilities:
    """What a peer measured about itself, and where a backbone could reach it (none: client mode)."""

    capabilities: Capabilities
    reachable: tuple[str, ...] = ()
    measured_at: float = 0.0  # unix time
    observed: str = ""  # our IP as the checking backbone saw it (shared.net.reachability)
    connectivity: str = "unchecked"  # "direct", "relayed", "client" or "unchecked"

    @property
    def client_mode(self) -> bool:
        """True when no backbone could dial us back: we accept no connections and aggregate nothing."""
        return not self.reachable

    def record(self) -> CapabilityRecord:
        """The DHT record of these capabilities."""
        return CapabilityRecord(
            capabilities=self.capabilities,
            reachable=list(self.reachable[:MAX_REACH_ADDRS]),
            client_mode=self.client_mode,
            measured_at=self.measured_at,
            observed=self.observed[:64],
            connectivity=self.connectivity[:16],
        )


async def measure_capabilities(
    host: Host,
    backbone_address: PeerAddress | str,
    throughput: float,
    *,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    device: str = "auto",
    precision: Precision = "fp32",
    reachable: Sequence[str] | None = None,
) -> MeasuredCapabilities:
    """Measure bandwidth and reachability against a backbone and combine them with ``throughput``.

    Args:
        host: our running host; its listen addresses are what the backbone tries to dial back.
        backbone_address: a node serving :class:`shared.net.probe.ProbeService` (every backbone does).
        throughput: samples/s from :func:`measure_samples_per_second` (0 for a peer without accelerator
            that only aggregates).
        probe_bytes: bytes moved each way by the bandwidth probe.
        device: the device training runs on (described in the capabilities, see :func:`device_description`;
            its accelerator's memory, :func:`device_memory`).
        precision: what ``throughput`` was measured in (:mod:`volunteer.precision`).
        reachable: where a backbone already dialed us back (:mod:`shared.net.reachability`); None: ask
            ``backbone_address`` now.

    Raises:
        ValueError: ``throughput`` is negative or not finite; ``probe_bytes`` out of range.
        PeerUnavailable, HandshakeError, RemoteError, ProtocolError: the backbone could not be probed.
    """
    if not (math.isfinite(throughput) and throughput >= 0):
        raise ValueError(f"throughput must be a finite number >= 0, got {throughput!r}")
    description = await trio.to_thread.run_sync(device_description, device)
    memory = 0 if device == "auto" else await trio.to_thread.run_sync(device_memory, device)
    upload, download = await measure_bandwidth(host, backbone_address, probe_bytes)
    if reachable is None:
        reachable = await check_reachable(host, backbone_address)
    capabilities = Capabilities(
        samples_per_second=min(throughput, _RATE_CEILING),
        upload_bps=min(upload, _RATE_CEILING),
        download_bps=min(download, _RATE_CEILING),
        device=description,
        precision=precision,
        memory_bytes=memory,
    )
    return MeasuredCapabilities(capabilities, tuple(reachable), measured_at=time.time())


async def publish_capabilities(
    dht: DHTNode, measured: MeasuredCapabilities, api: ApiClient | None = None
) -> int:
    """Publish ``measured`` in the DHT (our subkey of :data:`~protocols.probe.CAPABILITIES_KEY`) and, with
    ``api`` (pinned runs), to the ledger, signed with our identity key.

    Returns:
        On how many DHT nodes the record is now stored (0: nowhere).

    Raises:
        AdmissionError: the backbone refused the capabilities (we are not an admitted peer).
        PeerUnavailable: no backbone API answered.
    """
    stored = await dht.store(
        CAPABILITIES_KEY,
        msgspec.msgpack.encode(measured.record()),
        time.time() + CAPABILITIES_TTL,
        subkey=dht.host.peer_id.encode(),
    )
    if api is not None:
        await api.capabilities(dht.host.endpoint.identity, measured.capabilities)
    return stored


def with_reachability(
    published: MeasuredCapabilities, reach: Reachability, now: float
) -> MeasuredCapabilities | None:
    """``published`` with how peers reach us now (mode, observed IP, dialed-back addresses), or None when
    that is what it says already. A relay slot gained or lost (client mode to relayed and back) changes
    the mode after the capabilities were measured; the record must not go on saying the old one."""
    if (published.connectivity, published.observed, published.reachable) == (
        reach.mode,
        reach.observed,
        reach.reachable,
    ):
        return None
    return replace(
        published,
        connectivity=reach.mode,
        observed=reach.observed,
        reachable=reach.reachable,
        measured_at=now,
    )


Tracked = float | Capabilities | MeasuredCapabilities


class DriftTracker:
    """Decides when measurements have moved far enough from the published ones to republish.

    It tracks a single rate (say, samples/s), a :class:`~protocols.ledger.Capabilities` or a
    :class:`MeasuredCapabilities`. A rate has drifted when it differs from the *published* value by more
    than ``threshold`` times that value (a published 0 drifts to anything positive); the device and the
    set of reachable addresses (hence client mode) drift on any change, and so does switching between the
    three kinds. Comparing with what was published, not with the previous measurement, catches a slow
    creep as well as a jump.
    """

    def __init__(self, threshold: float = 0.25) -> None:
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
        self.threshold = threshold
        self.published: Tracked | None = None

    def update(self, current: Tracked) -> bool:
        """True if ``current`` should be published (the first time, or after drift); it then counts as
        published. False: the published numbers are still good.

        Raises:
            ValueError: a rate in ``current`` is negative or not finite.
        """
        rates, exact = _split(current)
        if any(not (math.isfinite(rate) and rate >= 0) for rate in rates):
            raise ValueError(f"rates must be finite numbers >= 0, got {rates}")
        if self.published is not None:
            old_rates, old_exact = _split(self.published)
            if old_exact == exact and not any(
                abs(new - old) > self.threshold * old for old, new in zip(old_rates, rates, strict=True)
            ):
                return False
        self.published = current
        return True


def _split(value: Tracked) -> tuple[tuple[float, ...], tuple[object, ...]]:
    """The rates of ``value`` (compared within the threshold) and what must match exactly."""
    if isinstance(value, MeasuredCapabilities):
        rates, exact = _split(value.capabilities)
        return rates, (*exact, frozenset(value.reachable))
    if isinstance(value, Capabilities):
        caps = value
        exact = ("capabilities", caps.device, caps.precision, caps.memory_bytes)
        return (caps.samples_per_second, caps.upload_bps, caps.download_bps), exact
    return (float(value),), ("rate",)
