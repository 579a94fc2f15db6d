"""Slices, parts, and the collection of averaged parts (shared.averaging.partition)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from shared.averaging.compression import Float16, Int8Blockwise, NoCompression
from shared.averaging.partition import (
    DEFAULT_PART_NUMEL,
    PART_BYTES,
    Part,
    Slice,
    SliceAssembly,
    make_slices,
    num_parts,
    part_bounds,
    part_numel_for,
    part_view,
    plan_parts,
    slice_views,
    split_slice,
)

sizes_strategy = st.lists(st.integers(0, 60), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(sizes_strategy, st.integers(1, 25))
def test_plan_parts_cover_the_vector_exactly_once_within_part_numel(
    sizes: list[int], part_numel: int
) -> None:
    slices = make_slices(sizes)
    parts = plan_parts(slices, part_numel)
    covered = np.zeros(sum(sizes), dtype=np.int64)
    for part in parts:
        covered[part.start : part.stop] += 1
        owner = slices[part.aggregator_index]
        assert 1 <= part.numel <= part_numel
        assert owner.start <= part.start < part.stop <= owner.stop
        assert part.offset == part.start - owner.start
        assert part_bounds(owner.numel, part_numel, part.part_index) == (
            part.offset,
            part.offset + part.numel,
        )
    assert np.all(covered == 1)
    for s in slices:
        indices = [p.part_index for p in parts if p.aggregator_index == s.aggregator_index]
        assert indices == list(range(num_parts(s.numel, part_numel)))


@settings(max_examples=100, deadline=None)
@given(sizes_strategy)
def test_slice_views_are_views_in_order(sizes: list[int]) -> None:
    flat = np.arange(sum(sizes), dtype=np.float32)
    slices = make_slices(sizes)
    views = slice_views(flat, slices)
    assert [v.size for v in views] == sizes
    assert np.array_equal(np.concatenate(views), flat)
    for view in views:
        if view.size:
            assert np.shares_memory(view, flat)
            view[0] = -1.0
    assert np.count_nonzero(flat == -1.0) == sum(1 for size in sizes if size)


def test_part_view_is_a_view() -> None:
    flat = np.zeros(10, dtype=np.float32)
    part = split_slice(Slice(0, 2, 10), part_numel=3)[1]
    assert (part.start, part.stop, part.offset) == (5, 8, 3)
    view = part_view(flat, part)
    assert np.shares_memory(view, flat)
    view[...] = 7.0
    assert flat.tolist() == [0, 0, 0, 0, 0, 7, 7, 7, 0, 0]
    with pytest.raises(ValueError, match="outside"):
        part_view(flat, Part(0, 0, 8, 11, 0))


def test_slice_views_reject_a_plan_that_does_not_tile_the_vector() -> None:
    flat = np.zeros(10, dtype=np.float32)
    with pytest.raises(ValueError, match="cover"):
        slice_views(flat, make_slices([4, 5]))
    with pytest.raises(ValueError, match="tile"):
        slice_views(flat, (Slice(0, 0, 4), Slice(1, 5, 10)))
    with pytest.raises(ValueError, match="flat"):
        slice_views(np.zeros((2, 5), dtype=np.float32), make_slices([10]))


@pytest.mark.parametrize("size", [-1, 2.5, True])
def test_make_slices_rejects_non_integer_or_negative_sizes(size: object) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        make_slices([3, size])  # type: ignore[list-item]


def test_make_slices_accepts_numpy_integers() -> None:
    assert make_slices(list(np.array([2, 0, 3]))) == (Slice(0, 0, 2), Slice(1, 2, 2), Slice(2, 2, 5))


def test_part_bounds_rejects_unknown_parts_and_bad_part_numel() -> None:
    with pytest.raises(ValueError, match="no part 4"):
        part_bounds(10, 3, 4)
    with pytest.raises(ValueError, match="part_numel"):
        num_parts(10, 0)


@pytest.mark.parametrize("codec", [NoCompression(), Float16(), Int8Blockwise()], ids=lambda c: c.name)
def test_part_numel_for_is_the_largest_size_that_fits(codec: NoCompression) -> None:
    numel = part_numel_for(codec)
    assert codec.encoded_size(numel) <= PART_BYTES < codec.encoded_size(numel + 1)
    with pytest.raises(ValueError, match="cannot hold"):
        part_numel_for(codec, max_bytes=0)


def test_default_part_numel_fits_four_mebibytes_uncompressed() -> None:
    assert NoCompression().encoded_size(DEFAULT_PART_NUMEL) == PART_BYTES == 4 * 1024 * 1024


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 50), st.integers(1, 12), st.randoms(use_true_random=False))
def test_slice_assembly_accepts_parts_in_any_order(numel: int, part_numel: int, random: object) -> None:
    expected = np.arange(numel, dtype=np.float32) * 0.5
    assembly = SliceAssembly(Slice(3, 100, 100 + numel), part_numel)
    parts = split_slice(assembly.slice, part_numel)
    random.shuffle(parts)  # type: ignore[attr-defined]
    for part in parts:
        assert not assembly.complete
        assembly.add(part.part_index, part.offset, expected[part.offset : part.offset + part.numel].copy())
    assert assembly.complete and assembly.missing() == []
    assert np.array_equal(assembly.values, expected)


def test_slice_assembly_withholds_values_until_complete() -> None:
    assembly = SliceAssembly(Slice(0, 0, 5), part_numel=2)
    assembly.add(1, 2, np.ones(2, dtype=np.float32))
    assert assembly.missing() == [0, 2]
    with pytest.raises(ValueError, match=r"misses parts \[0, 2\]"):
        _ = assembly.values


@pytest.mark.parametrize(
    ("part_index", "offset", "values", "match"),
    [
        (3, 6, np.ones(1, dtype=np.float32), "no part 3"),
        (1, 3, np.ones(2, dtype=np.float32), "must cover"),
        (1, 2, np.ones(1, dtype=np.float32), "must cover"),
        (1, 2, np.ones(2, dtype=np.float64), "must cover"),
        (1, 2, np.array([1.0, np.nan], dtype=np.float32), "NaN or Inf"),
        (2, 4, np.array([np.inf], dtype=np.float32), "NaN or Inf"),
        (0, 0, np.ones(2, dtype=np.float32), "duplicate"),
    ],
)
def test_slice_assembly_rejects_bad_parts(
    part_index: int, offset: int, values: np.ndarray, match: str
) -> None:
    assembly = SliceAssembly(Slice(0, 0, 5), part_numel=2)
    assembly.add(0, 0, np.zeros(2, dtype=np.float32))
    with pytest.raises(ProtocolError, match=match):
        assembly.add(part_index, offset, values)
    assert assembly.missing() == [1, 2]  # a refused part changes nothing
