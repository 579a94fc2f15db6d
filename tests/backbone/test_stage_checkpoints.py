"""A swarm run's backbone keeps each stage's checkpoints on that stage's keys, in that stage's directory,
and never stores (so never announces or serves as its own) another stage's state (backbone.checkpointer,
"Swarm runs"; issue 17)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from backbone.checkpointer import (
    Checkpointer,
    CheckpointScope,
    check_scope,
    checkpoint_scopes,
    keep_scoped_checkpoints,
    open_stores,
    scope_directory,
)
from backbone.checkpoints import CheckpointStore
from protocols.swarm import MAX_STAGES, stage_tag, stage_training_keys
from protocols.training import TRAINING_KEYS, SyncSpec, TrainingSpec
from shared.errors import StateError
from shared.state.blob import encode_state, read_metadata, state_digest
from shared.state.transfer import (
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
)
from tests.backbone.test_checkpointer import LIMIT, RUN, start_node

STAGES = 3
SWARM = TrainingSpec(sync=SyncSpec(mode="swarm", stages=STAGES), keep_checkpoints=2)


def stage_blob(step: int, stage: int | None, stages: int = STAGES, fill: float = 1.0) -> bytes:
    """A state of ``stage`` (None: the run's data-parallel state) as its trainer tags it."""
    metadata = {"step": str(step), "run_id": RUN, "task": "tiny-mlm"}
    if stage is not None:
        metadata["stage"] = stage_tag(stage, stages)
    tensors = {"model/w": np.full(3000, fill + step, dtype=np.float32)}
    return encode_state(tensors, metadata)


# ------------------------------------------------------------------------------------------ pure rules


@given(st.integers(min_value=1, max_value=MAX_STAGES))
def test_stage_scopes_have_disjoint_keys_and_directories(stages: int) -> None:
    spec = TrainingSpec(sync=SyncSpec(mode="swarm", stages=stages))
    scopes = checkpoint_scopes(spec)
    assert [s.stage for s in scopes] == list(range(stages))
    assert all(s.keys == stage_training_keys(k) and s.stages == stages for k, s in enumerate(scopes))
    keys = [key for s in scopes for key in (s.keys.progress, s.keys.state, s.keys.averaging)]
    keys += [TRAINING_KEYS.progress, TRAINING_KEYS.state, TRAINING_KEYS.averaging]
    assert len(set(keys)) == len(keys)  # no stage shares a key with another, nor with the run's
    root = Path("/ckpt")
    directories = {scope_directory(root, s) for s in scopes}
    assert len(directories) == stages and root not in directories
    assert all(d.parent == root for d in directories)


def test_a_data_parallel_run_keeps_the_runs_checkpoints_only() -> None:
    assert checkpoint_scopes(TrainingSpec()) == [CheckpointScope()]
    assert scope_directory(Path("/ckpt"), CheckpointScope()) == Path("/ckpt")
    # a swarm mode without declared stages has no stage keys to watch: the run's (as backbone.steps)
    assert checkpoint_scopes(TrainingSpec(sync=SyncSpec(mode="swarm", stages=0))) == [CheckpointScope()]


@given(st.integers(min_value=1, max_value=8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))))
def test_check_scope_accepts_exactly_the_scopes_own_stage(case: tuple[int, int]) -> None:
    stages, stage = case
    scopes = checkpoint_scopes(TrainingSpec(sync=SyncSpec(mode="swarm", stages=stages)))
    metadata = read_metadata(stage_blob(1, stage, stages))
    for scope in scopes:
        if scope.stage == stage:
            check_scope(metadata, scope)
        else:
            with pytest.raises(StateError, match=f"stage '{stage}/{stages}'"):
                check_scope(metadata, scope)
    with pytest.raises(StateError, match="not the run's data-parallel state"):
        check_scope(metadata, CheckpointScope())  # a stage's state is never the run's
    other_count = CheckpointScope(stage_training_keys(stage), stage, stages + 1)
    with pytest.raises(StateError):  # the same index of another split is another stage
        check_scope(metadata, other_count)
    untagged = read_metadata(stage_blob(1, None))
    check_scope(untagged, CheckpointScope())
    with pytest.raises(StateError, match="a state of no stage"):
        check_scope(untagged, scopes[stage])


def test_stage_stores_and_the_runs_store_do_not_touch_each_others_files(tmp_path: Path) -> None:
    stores = open_stores(tmp_path, SWARM)
    assert [scope.stage for scope, _ in stores] == [0, 1, 2]
    for scope, store in stores:
        assert store.directory == tmp_path / f"stage-{scope.stage}" and store.keep == 2
        for step in (1, 2, 3):  # keep-last-2 per stage
            store.save(stage_blob(step, scope.stage), step)
        assert [e.step for e in store.entries()] == [2, 3]
    # the same data dir opened for a data-parallel run: its store ignores the stage directories
    ((run_scope, run_store),) = open_stores(tmp_path, TrainingSpec(keep_checkpoints=1))
    assert run_scope == CheckpointScope() and run_store.directory == tmp_path
    run_store.save(stage_blob(5, None), 5)
    run_store.save(stage_blob(6, None), 6)
    reopened = open_stores(tmp_path, SWARM)
    assert [[e.step for e in store.entries()] for _, store in reopened] == [[2, 3]] * STAGES
    assert [e.step for e in CheckpointStore(tmp_path, keep=1).entries()] == [6]


# ------------------------------------------------------------------------------- through a real DHT


async def test_each_stage_checkpointer_stores_its_stages_state_and_refuses_another_stages(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backbone = await start_node(nursery, "backbone")
    server = StateServer(backbone.host, backbone=True)  # one per host: every stage serves through it
    stores = open_stores(tmp_path, SWARM)
    checkpointers = [Checkpointer(backbone, server, store, SWARM, scope=scope) for scope, store in stores]
    blobs = {k: stage_blob(4, k) for k in range(STAGES)}
    for k in (0, 1):  # stage 2 has no state announced yet
        node = await start_node(nursery, "volunteer", backbone)
        await announce_state(
            node.dht, StateServer(node.host).offer(4, blobs[k]), stage_training_keys(k).state
        )
    # a stranger announces stage 0's state (a valid state, digest and step) under stage 2's key
    stranger = await start_node(nursery, "volunteer", backbone)
    stranger_server = StateServer(stranger.host)
    await announce_state(stranger.dht, stranger_server.offer(4, blobs[0]), stage_training_keys(2).state)
    # and under the run's own key: a swarm run's backbone does not even read that one
    await announce_state(stranger.dht, stranger_server.offer(4, blobs[0]))

    stored = [await c.poll_once() for c in checkpointers]

    assert [e.digest if e else None for e in stored] == [state_digest(blobs[0]), state_digest(blobs[1]), None]
    assert stores[0][1].path(state_digest(blobs[0])).read_bytes() == blobs[0]
    assert stores[2][1].entries() == []  # stage 0's state is not stage 2's checkpoint
    assert stranger_server.statistics().bytes_served == len(blobs[0])  # fetched, checked, refused
    assert await checkpointers[2].poll_once() is None  # and not fetched again
    assert stranger_server.statistics().bytes_served == len(blobs[0])
    assert not (tmp_path / "index.json").exists()  # nothing stored as the run's


async def test_keep_scoped_checkpoints_announces_each_stages_newest_under_its_own_key(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stores = open_stores(tmp_path, SWARM)
    blobs = {k: stage_blob(7, k) for k in range(STAGES)}
    for scope, store in stores:  # stored by an earlier run of the backbone
        assert scope.stage is not None
        store.save(blobs[scope.stage], 7)
    backbone = await start_node(nursery, "backbone")
    server = StateServer(backbone.host, backbone=True)
    await nursery.start(keep_scoped_checkpoints, backbone, server, stores, SWARM)
    newcomer = await start_node(nursery, "volunteer", backbone)

    addresses = await presence_addresses(newcomer.dht)
    for k in range(STAGES):
        key = stage_training_keys(k).state
        with trio.fail_after(10):
            while backbone.peer_id not in (found := await read_announcements(newcomer.dht, key=key)):
                await trio.sleep(0.05)
        announcement = found[backbone.peer_id].announcement
        assert (announcement.step, announcement.digest, announcement.backbone) == (
            7,
            state_digest(blobs[k]),
            True,
        )
        sources = [(a, announcement) for a in addresses[backbone.peer_id]]
        assert await fetch_state(newcomer.host, sources, max_bytes=LIMIT) == blobs[k]
    assert backbone.peer_id not in await read_announcements(newcomer.dht)  # no run state announced
