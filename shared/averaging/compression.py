"""Codecs for gradient parts on the wire: none, fp16, and 8-bit blockwise quantization.

Every codec maps a 1-D float32 array to bytes and back, behind the small :class:`Codec` protocol. Layouts
are little-endian and fixed by the codec's name (:data:`protocols.averaging.CodecName`):

``none``
    ``numel x float32``. Exact.

``fp16``
    ``numel x float16``, round-to-nearest-even after clipping to ``[-65504, 65504]``. For ``|x| ≤ 65504``
    the error is ``|x - x̂| ≤ max(2**-11 |x|, 2**-25)``: relative ``2**-11`` (half an ulp) for normal fp16
    values, absolute ``2**-25`` in the subnormal range ``|x| < 2**-14``. Beyond the range it saturates:
    ``x̂ = ±65504``.

``int8-blockwise`` (seed 004 App. I; Dettmers et al. 2022, "8-bit optimizers via block-wise quantization")
    ``nblocks = ceil(numel / B)`` float32 *steps* ``s_b``, then ``numel`` int8 values ``q`` (``B = 4096``
    on the wire). For block ``b`` with ``a_b = max |x_i|`` over the block:

        s_b = round_down_16_bits(a_b / 127)        (0 when a_b < 2**-119)
        q_i = round_to_nearest(x_i / s_b)  ∈ [-127, 127]
        x̂_i = q_i · s_b

    ``s_b`` keeps at most 16 significant bits, so ``q_i · s_b`` (7 + 16 bits) is exact in float32 and the
    decoded grid point is exactly the one the encoder chose; rounding down keeps ``s_b ≤ a_b / 127``
    and ``|x_i / s_b| ≤ 127 (1 + 2**-15) < 127.5``, so ``q_i`` never needs clipping. The quotient is
    computed in float64, whose error (< 2**-45) is far below the smallest possible distance of ``x_i / s_b``
    from a rounding tie (≥ 2**-25), so ``q_i`` is the exact nearest integer. Hence, exactly::

        |x_i - x̂_i| ≤ s_b / 2 ≤ a_b / 254          whenever a_b ≥ 2**-119

    Blocks with ``a_b < 2**-119`` (≈1.5e-36, including all-zero blocks) would need subnormal steps that
    float32 cannot represent with enough precision; they decode to exact zeros (error ``≤ a_b``).

Encoders refuse NaN/Inf input (``ValueError``): garbage is never encoded. Decoders check *structure*
(lengths, steps finite, non-negative and ≤ float32 max / 127, no int8 ``-128``) and raise
:class:`~protocols.errors.ProtocolError`; the finiteness and norm of decoded values are the reducer's
business. All work is vectorized numpy over whole blocks; int8 quantization runs in float64 chunks of
:data:`_CHUNK` elements to bound temporary memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from protocols.averaging import INT8_BLOCK, CodecName
from protocols.errors import ProtocolError

__all__ = ["Codec", "Float16", "Int8Blockwise", "NoCompression", "codec_by_name"]

Float32Array = npt.NDArray[np.float32]
FP16_MAX = 65504.0
_F32_MAX = float(np.finfo(np.float32).max)
_TINY_ABSMAX = 2.0**-119  # smallest block absmax whose step a_b / 127 is a normal float32
_STEP_BITS = 16
_CHUNK = 1 << 16  # elements per float64 scratch chunk while quantizing


class Codec(Protocol):
    """Encodes 1-D float32 arrays to bytes and back; one instance per wire format."""

    @property
    def name(self) -> CodecName:
        """The codec's wire name (``PartHeader.codec``)."""
        ...

    def encoded_size(self, numel: int) -> int:
        """Bytes that ``numel`` elements take once encoded."""
        ...

    def encode(self, x: Float32Array) -> bytes:
        """Encode a 1-D float32 array.

        Raises:
            ValueError: ``x`` is not 1-D float32, or holds NaN/Inf.
        """
        ...

    def decode(
        self, data: bytes | memoryview, numel: int, *, out: Float32Array | None = None
    ) -> Float32Array:
        """Decode ``numel`` elements, into ``out`` if given (a 1-D float32 array of ``numel`` elements).

        Raises:
            ProtocolError: ``data`` has the wrong length or an invalid structure.
        """
        ...


def _check_input(x: Float32Array) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        raise ValueError(f"expected a 1-D float32 array, got {getattr(x, 'dtype', type(x))!r}")
    with np.errstate(over="ignore", invalid="ignore"):
        square = float(np.dot(x, x))  # one fast pass; NaN/Inf propagate, huge finite values overflow
    if not np.isfinite(square) and not (np.isfinite(x.min()) and np.isfinite(x.max())):
        raise ValueError("refusing to encode NaN or Inf")


def _to_bytes(array: npt.NDArray[np.generic]) -> bytes:
    return bytes(np.ascontiguousarray(array).data)  # measured faster than ndarray.tobytes()


def _view(data: bytes | memoryview, numel: int, expected: int) -> memoryview:
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    view = memoryview(data).cast("B")
    if view.nbytes != expected:
        raise ProtocolError(f"encoded part has {view.nbytes} bytes, expected {expected}")
    return view


def _output(out: Float32Array | None, numel: int) -> Float32Array:
    if out is None:
        return np.empty(numel, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (numel,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be contiguous float32 of shape ({numel},), got {out.dtype} {out.shape}")
    return out


@dataclass(frozen=True)
class NoCompression:
    """Raw little-endian float32: 4 bytes per element, exact."""

    @property
    def name(self) -> CodecName:
        return "none"

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: Float32Array) -> bytes:
        _check_input(x)
        return _to_bytes(x.astype("<f4", copy=False))

    def decode(
        self, data: bytes | memoryview, numel: int, *, out: Float32Array | None = None
    ) -> Float32Array:
        """Without ``out``, a read-only ``data`` (e.g. ``bytes``) is wrapped without copying."""
        view = _view(data, numel, self.encoded_size(numel))
        values = np.frombuffer(view, dtype="<f4", count=numel)
        if out is None and view.readonly:
            return values.astype(np.float32, copy=False)
        target = _output(out, numel)
        target[...] = values
        return target


@dataclass(frozen=True)
class Float16:
    """IEEE half precision: 2 bytes per element; see the module docstring for the error bound."""

    @property
    def name(self) -> CodecName:
        return "fp16"

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: Float32Array) -> bytes:
        _check_input(x)
        if x.size and (x.max() > FP16_MAX or x.min() < -FP16_MAX):
            x = np.clip(x, np.float32(-FP16_MAX), np.float32(FP16_MAX))
        return _to_bytes(x.astype("<f2"))

    def decode(
        self, data: bytes | memoryview, numel: int, *, out: Float32Array | None = None
    ) -> Float32Array:
        view = _view(data, numel, self.encoded_size(numel))
        target = _output(out, numel)
        target[...] = np.frombuffer(view, dtype="<f2", count=numel)
        return target


@dataclass(frozen=True)
class Int8Blockwise:
    """8-bit blockwise quantization with one float32 step per ``block`` elements (module docstring).

    Args:
        block: elements per step; the wire name ``int8-blockwise`` means ``block=4096``.
    """

    block: int = INT8_BLOCK

    def __post_init__(self) -> None:
        if not 1 <= self.block <= 1 << 24:
            raise ValueError(f"block must be in [1, 2**24], got {self.block}")

    @property
    def name(self) -> CodecName:
        return "int8-blockwise"

    def encoded_size(self, numel: int) -> int:
        return 4 * -(-numel // self.block) + numel

    def _blocks(self, x: npt.NDArray[np.generic]) -> list[npt.NDArray[np.generic]]:
        """``x`` as at most two 2-D views: the full blocks, and the short last block if any."""
        full = x.size // self.block * self.block
        parts = [x[:full].reshape(-1, self.block)] if full else []
        if full < x.size:
            parts.append(x[full:].reshape(1, -1))
        return parts

    def encode(self, x: Float32Array) -> bytes:
        _check_input(x)
        n = x.size
        nblocks = -(-n // self.block)
        buffer = np.empty(4 * nblocks + n, dtype=np.uint8)
        q = buffer[4 * nblocks :].view(np.int8)
        blocks = self._blocks(x)
        absmax = np.concatenate([np.maximum(b.max(axis=1), -b.min(axis=1)) for b in blocks] or [[]])
        mantissa, exponent = np.frexp(absmax.astype(np.float64) / 127.0)
        step = np.ldexp(np.floor(mantissa * 2.0**_STEP_BITS) / 2.0**_STEP_BITS, exponent)
        step[absmax < _TINY_ABSMAX] = 0.0
        buffer[: 4 * nblocks].view("<f4")[...] = step  # exact: at most 16 significant bits, normal range
        inverse = np.divide(1.0, step, out=np.zeros_like(step), where=step > 0.0)
        rows_per_chunk = max(1, _CHUNK // self.block)
        scratch = np.empty((rows_per_chunk, self.block), dtype=np.float64)
        row = 0
        for x_rows, q_rows in zip(blocks, self._blocks(q), strict=True):
            width = x_rows.shape[1]
            for r0 in range(0, x_rows.shape[0], rows_per_chunk):
                r1 = min(r0 + rows_per_chunk, x_rows.shape[0])
                tmp = scratch[: r1 - r0, :width]
                np.multiply(x_rows[r0:r1], inverse[row + r0 : row + r1, None], out=tmp)
                np.rint(tmp, out=tmp)
                q_rows[r0:r1] = tmp  # |tmp| <= 127 by construction (module docstring)
            row += x_rows.shape[0]
        return _to_bytes(buffer)

    def decode(
        self, data: bytes | memoryview, numel: int, *, out: Float32Array | None = None
    ) -> Float32Array:
        view = _view(data, numel, self.encoded_size(numel))
        nblocks = -(-numel // self.block)
        target = _output(out, numel)
        steps = np.frombuffer(view, dtype="<f4", count=nblocks)
        q = np.frombuffer(view, dtype=np.int8, offset=4 * nblocks, count=numel)
        if nblocks:
            if not np.isfinite(steps).all():
                raise ProtocolError("int8-blockwise part carries a NaN or Inf scale")
            if steps.min() < 0.0 or steps.max() > _F32_MAX / 127.0:
                raise ProtocolError("int8-blockwise part carries a negative or out-of-range scale")
            if q.min() < -127:
                raise ProtocolError("int8-blockwise part carries the value -128, which no encoder emits")
        row = 0
        for q_rows, out_rows in zip(self._blocks(q), self._blocks(target), strict=True):
            rows = q_rows.shape[0]
            np.multiply(q_rows, steps[row : row + rows, None].astype(np.float32), out=out_rows)
            row += rows
        return target


_CODECS: dict[str, Codec] = {
    "none": NoCompression(),
    "fp16": Float16(),
    "int8-blockwise": Int8Blockwise(),
}


def codec_by_name(name: str) -> Codec:
    """The codec a wire name stands for (``Int8Blockwise`` with the wire's block of 4096).

    Raises:
        ValueError: unknown name.
    """
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(_CODECS)}") from None
