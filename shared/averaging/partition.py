"""Split a flat gradient into aggregator slices and wire-sized parts, and gather averaged parts back.

Layout of a flat float32 vector of ``P`` elements under a plan of slice sizes ``n_0 … n_{m-1}`` (integers
from the LP's largest-remainder apportionment, ``Σ n_j = P``) and a part size ``L``::

    [0 ............................................................................ P)
    [ slice 0: aggregator 0, n_0 ][ slice 1: aggregator 1, n_1 ] ... [ slice m-1 ]
    [ part 0 | part 1 | ... |p k]                                     (an empty slice has no parts)
      offset 0, L, 2L, ...  (element offsets inside the slice; the last part may be shorter)

Part ``k`` of a slice of ``n`` elements covers offsets ``[k·L, min((k+1)·L, n))``. This canonical layout is
recomputed from ``(n, L)`` by senders, aggregators and receivers alike, so a header's ``(part_index,
offset, numel)`` is checked against it, never trusted. Everything here returns *views* of the caller's
vector (numpy basic slicing), never copies; the only buffer allocated is :class:`SliceAssembly`'s, which
collects averaged parts so a slice is written into the local vector whole or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocols.errors import ProtocolError

from .compression import Codec

__all__ = [
    "DEFAULT_PART_NUMEL",
    "PART_BYTES",
    "Part",
    "Slice",
    "SliceAssembly",
    "make_slices",
    "num_parts",
    "part_bounds",
    "part_numel_for",
    "part_view",
    "plan_parts",
    "slice_views",
    "split_slice",
]

Float32Array = npt.NDArray[np.float32]
#: Default ceiling on one encoded part: small enough to pipeline, large enough to amortize headers.
PART_BYTES = 4 * 1024 * 1024
#: Elements per part such that even uncompressed float32 parts stay within :data:`PART_BYTES`.
DEFAULT_PART_NUMEL = PART_BYTES // 4
#: The smallest part size chosen automatically: below it a part's round trip costs more than its bytes.
MIN_AUTO_PART_NUMEL = 16 * 1024


def auto_part_numel(slice_sizes: Sequence[int], parts_per_slice: int = 8) -> int:
    """A part size that cuts the largest slice into about ``parts_per_slice`` parts, so that averaged
    parts flow back while later ones still arrive, within ``[MIN_AUTO_PART_NUMEL, DEFAULT_PART_NUMEL]``."""
    if parts_per_slice < 1:
        raise ValueError(f"parts_per_slice must be >= 1, got {parts_per_slice}")
    largest = max(slice_sizes, default=0)
    return max(MIN_AUTO_PART_NUMEL, min(DEFAULT_PART_NUMEL, -(-largest // parts_per_slice)))


@dataclass(frozen=True, slots=True)
class Slice:
    """Elements ``[start, stop)`` of the flat vector, averaged by aggregator ``aggregator_index``."""

    aggregator_index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Part:
    """Elements ``[start, stop)`` of the flat vector: part ``part_index`` of aggregator
    ``aggregator_index``'s slice, at element ``offset`` inside that slice (what ``PartHeader.offset`` says).
    """

    aggregator_index: int
    part_index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def make_slices(sizes: Sequence[int]) -> tuple[Slice, ...]:
    """Consecutive slices of the given sizes; slice ``j`` belongs to aggregator ``j``.

    Raises:
        ValueError: a size is negative or not an integer.
    """
    slices = []
    start = 0
    for index, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
            raise ValueError(f"slice size {size!r} of aggregator {index} is not a non-negative integer")
        slices.append(Slice(index, start, start + int(size)))
        start += int(size)
    return tuple(slices)


def _check_slices(slices: Sequence[Slice], numel: int) -> None:
    position = 0
    for s in slices:
        if s.start != position or s.stop < s.start:
            raise ValueError(f"slices must tile [0, {numel}) in order; {s} does not start at {position}")
        position = s.stop
    if position != numel:
        raise ValueError(f"slices cover [0, {position}) but the vector has {numel} elements")


def slice_views(flat: Float32Array, slices: Sequence[Slice]) -> list[Float32Array]:
    """Views ``flat[start:stop]`` of every slice (no copies).

    Raises:
        ValueError: ``flat`` is not 1-D, or the slices do not tile it exactly.
    """
    if flat.ndim != 1:
        raise ValueError(f"expected a flat vector, got shape {flat.shape}")
    _check_slices(slices, flat.size)
    return [flat[s.start : s.stop] for s in slices]


def _check_part_numel(part_numel: int) -> None:
    if part_numel < 1:
        raise ValueError(f"part_numel must be >= 1, got {part_numel}")


def num_parts(numel: int, part_numel: int) -> int:
    """Number of parts of a slice of ``numel`` elements: ``ceil(numel / part_numel)``."""
    _check_part_numel(part_numel)
    return -(-numel // part_numel)


def part_bounds(numel: int, part_numel: int, part_index: int) -> tuple[int, int]:
    """``(offset, stop)`` of part ``part_index`` inside a slice of ``numel`` elements.

    Raises:
        ValueError: no such part.
    """
    if not 0 <= part_index < num_parts(numel, part_numel):
        raise ValueError(f"a slice of {numel} elements has no part {part_index} (part size {part_numel})")
    offset = part_index * part_numel
    return offset, min(offset + part_numel, numel)


def split_slice(slice_: Slice, part_numel: int = DEFAULT_PART_NUMEL) -> list[Part]:
    """The parts of one slice in order, each of at most ``part_numel`` elements."""
    parts = []
    for index in range(num_parts(slice_.numel, part_numel)):
        offset, stop = part_bounds(slice_.numel, part_numel, index)
        parts.append(Part(slice_.aggregator_index, index, slice_.start + offset, slice_.start + stop, offset))
    return parts


def plan_parts(slices: Sequence[Slice], part_numel: int = DEFAULT_PART_NUMEL) -> list[Part]:
    """Every part of every slice, slice by slice; together they cover the vector exactly once."""
    return [part for s in slices for part in split_slice(s, part_numel)]


def part_view(flat: Float32Array, part: Part) -> Float32Array:
    """The view ``flat[part.start:part.stop]`` (no copy)."""
    if not 0 <= part.start <= part.stop <= flat.size:
        raise ValueError(f"{part} lies outside a vector of {flat.size} elements")
    return flat[part.start : part.stop]


def part_numel_for(codec: Codec, max_bytes: int = PART_BYTES) -> int:
    """The largest part size whose encoding with ``codec`` fits in ``max_bytes``.

    Every peer of a round must use the same value (it defines the canonical layout).

    Raises:
        ValueError: not even one element fits.
    """
    if codec.encoded_size(1) > max_bytes:
        raise ValueError(f"{max_bytes} bytes cannot hold one {codec.name} element")
    low, high = 1, max_bytes  # every codec takes at least one byte per element
    while low < high:  # invariant: low fits; encoded_size is monotone in numel
        middle = (low + high + 1) // 2
        if codec.encoded_size(middle) <= max_bytes:
            low = middle
        else:
            high = middle - 1
    return low


class SliceAssembly:
    """Collects the averaged parts of one slice until it is complete.

    Parts may arrive in any order; each is checked against the canonical layout and for finite values,
    then copied into a private buffer. Only a complete assembly yields :attr:`values`, so the caller never
    writes half a slice into its vector.

    Args:
        slice_: the slice being collected.
        part_numel: the round's part size.
    """

    def __init__(self, slice_: Slice, part_numel: int = DEFAULT_PART_NUMEL) -> None:
        self.slice = slice_
        self.part_numel = part_numel
        self._buffer = np.empty(slice_.numel, dtype=np.float32)
        self._missing = set(range(num_parts(slice_.numel, part_numel)))

    def add(self, part_index: int, offset: int, values: Float32Array) -> None:
        """Store one averaged part.

        Raises:
            ProtocolError: not a part of this slice's layout, a duplicate, not 1-D float32, or NaN/Inf.
        """
        try:
            start, stop = part_bounds(self.slice.numel, self.part_numel, part_index)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        if offset != start or values.shape != (stop - start,) or values.dtype != np.float32:
            raise ProtocolError(
                f"averaged part {part_index} must cover offsets [{start}, {stop}) as float32, "
                f"got offset {offset} and {values.dtype} {values.shape}"
            )
        if part_index not in self._missing:
            raise ProtocolError(f"duplicate averaged part {part_index}")
        if values.size and not (np.isfinite(values.min()) and np.isfinite(values.max())):
            raise ProtocolError(f"averaged part {part_index} holds NaN or Inf")
        self._buffer[start:stop] = values
        self._missing.discard(part_index)

    def missing(self) -> list[int]:
        """Indices of the parts not received yet, ascending."""
        return sorted(self._missing)

    @property
    def complete(self) -> bool:
        return not self._missing

    @property
    def values(self) -> Float32Array:
        """The whole averaged slice.

        Raises:
            ValueError: parts are still missing.
        """
        if self._missing:
            raise ValueError(
                f"slice of aggregator {self.slice.aggregator_index} misses parts {self.missing()}"
            )
        return self._buffer
