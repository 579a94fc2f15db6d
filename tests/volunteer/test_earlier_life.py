"""A restarted volunteer whose earlier process's steps were taken again differently after a rollback
reports them discarded (volunteer.collab.sync, "A restarted volunteer"; shared.state.lineage, "An earlier
life"), so the ledger stops crediting them.

What the two-backbone soak hit: volunteer2 held step 9 and was killed; the run resumed from a backbone's
checkpoint of step 1 and the survivors took steps 2 and 3 again. volunteer2 restarted and loaded the new
step 3: it reported only the steps above 3 discarded, and its lost steps 2 and 3 (another history than the
new ones) stayed credited. Here real peers take steps 1..3; a restarted peer's report journal (a real
:class:`~volunteer.reporting.Reporter` in its data dir) holds its earlier process's steps with their
fingerprints, and it downloads the survivors' step 3 over loopback.

What the two-backbone soak hit next, under load: a volunteer alone took steps 1..5 (no checkpoint but
step 0's stored yet) and was killed; the survivors ruled the state of step 5 lost with its holder
(:mod:`shared.alone`, rule (d)) and went on from step 0, and so did the restarted volunteer, from its
own initial state: it loaded nothing, so its earlier steps 1..5 were never compared with anything, never
reported discarded, and the soak counted them as a fork. The same when it had computed a micro-batch on
its initial state before downloading a state (it was then "anchored" at step 0, and the load compared
only this life's steps). Whatever state it first steps from, loaded or its own, decides its earlier life.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio

from protocols.ledger import ContributionReport
from protocols.training import TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node
from volunteer.collab.optimizer import CollaborativeOptimizer
from volunteer.collab.trainer import LocalTrainer
from volunteer.journal import JournaledStep
from volunteer.reporting import Reporter

from .test_collab import CONFIG, LinearTask, examples, see_each_other, spec, start_collab, start_nodes

ME = Identity.generate()
RUN = "collab-test"
B = 8


def other(step: int) -> bytes:
    """A fingerprint of another history than the survivors' (the earlier process's lost steps)."""
    return b"lost%04d" % step


async def rejoin(
    nursery: trio.Nursery, earlier: dict[int, bytes | None], data_dir: Path, *, computed_first: bool = False
) -> tuple[list[tuple[int, int]], dict[int, bytes]]:
    """Two peers take steps 1..3; a peer restarted in ``data_dir``, whose earlier process journaled the
    steps ``earlier`` (step -> fingerprint; None: the survivors' fingerprint at that step), downloads
    their step 3 (``computed_first``: after a micro-batch on its initial state). Returns the ranges its
    next report lists as discarded, and its lineage after."""
    training = spec(2 * B)
    nodes = await start_nodes(nursery, 3)
    first = await start_collab(nursery, nodes[0], training)
    second = await start_collab(nursery, nodes[1], training)
    task = LinearTask()
    data = examples(3, 6 * B)
    await see_each_other([first, second])

    async def step(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + B]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    for number in range(3):
        async with trio.open_nursery() as group:
            group.start_soon(step, first, 2 * number * B)
            group.start_soon(step, second, (2 * number + 1) * B)
    survivors = first.trainer.lineage
    assert first.trainer.step == 3 and survivors == second.trainer.lineage

    journal_earlier_life(data_dir, {n: fingerprint or survivors[n] for n, fingerprint in earlier.items()})
    reporter, rejoined = await restart(nursery, nodes[2], training, data_dir)
    assert reporter.last_step == max(earlier)
    await rejoined.refresh_view()
    if computed_first:  # a micro-batch on its initial state first: "anchored" at step 0, then behind
        await rejoined.accumulate(task.collate(data[:B]))
    with trio.fail_after(30):
        assert await rejoined.sync_state() == 3
    assert rejoined.trainer.lineage[3] == survivors[3]
    return reported_discards(reporter), Reporter(RUN, ME, None, data_dir).lineage


def journal_earlier_life(data_dir: Path, earlier: dict[int, bytes]) -> None:
    """The earlier process in ``data_dir`` reported the steps ``earlier`` (step -> fingerprint), then was
    killed: the next process replays its journal."""
    earlier_life = Reporter(RUN, ME, None, data_dir, interval=1e9)
    for number, fingerprint in earlier.items():
        earlier_life.record(JournaledStep(number, B, 0.1, 0, float(number)), fingerprint)
    earlier_life.journal.close()


async def restart(
    nursery: trio.Nursery, node: Node, training: TrainingSpec, data_dir: Path
) -> tuple[Reporter, CollaborativeOptimizer]:
    """The restarted process, wired as ``volunteer.session`` wires it: its reporter replays the journal."""
    reporter = Reporter(RUN, ME, None, data_dir, interval=1e9)
    trainer = LocalTrainer(LinearTask(), training, RUN)  # type: ignore[arg-type]
    rejoined = CollaborativeOptimizer(
        node,
        trainer,
        training,
        config=CONFIG,
        receipts=reporter.book,
        previous_life=reporter.last_step or None,
        previous_lineage=reporter.lineage,
        on_discard=reporter.discard,
    )
    await nursery.start(rejoined.run)
    return reporter, rejoined


def reported_discards(reporter: Reporter) -> list[tuple[int, int]]:
    """The step ranges the reporter's reports list as discarded (the interval closed now)."""
    reporter.close_interval()
    return [
        (r.first, r.last)
        for signed, _ in reporter._pending
        for r in msgspec.msgpack.decode(signed.report, type=ContributionReport).discarded
    ]


async def test_earlier_steps_taken_again_differently_are_discarded(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    discarded, lineage = await rejoin(nursery, {1: None, 2: other(2), 3: other(3)}, tmp_path)
    assert discarded == [(2, 3)]  # the old steps 2, 3: not the run's (the step numbers alone said none)
    assert sorted(lineage) == [1]  # reported once: a later restart does not report them again


async def test_earlier_steps_beyond_and_unlike_the_loaded_state_are_discarded(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    discarded, _ = await rejoin(nursery, {n: other(n) if n > 1 else None for n in range(1, 10)}, tmp_path)
    assert discarded == [(2, 9)]  # the soak's volunteer2: it held step 9, the run redid 2 and 3


async def test_earlier_steps_the_loaded_state_took_are_kept(nursery: trio.Nursery, tmp_path: Path) -> None:
    discarded, lineage = await rejoin(nursery, {1: None, 2: None, 3: None}, tmp_path)
    assert discarded == []  # the same steps: the run's, still credited
    assert sorted(lineage) == [1, 2, 3]


async def test_earlier_steps_are_discarded_when_the_restarted_peer_loaded_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The soak's lone volunteer: it took steps 1..5 alone and was killed; the survivors went back to
    step 0 (rule (d)), and it restarted at step 0 too: the three step from their initial state, nothing
    is downloaded, and its earlier steps 1..5 are reported discarded before its new step 1 is."""
    journal_earlier_life(tmp_path, {n: other(n) for n in range(1, 6)})
    training = spec(3 * B)
    nodes = await start_nodes(nursery, 3)
    survivors = [await start_collab(nursery, node, training) for node in nodes[:2]]
    reporter, rejoined = await restart(nursery, nodes[2], training, tmp_path)
    peers = [*survivors, rejoined]
    await see_each_other(peers)
    task, data = LinearTask(), examples(5, 3 * B)

    async def step(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + B]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    with trio.fail_after(60):
        async with trio.open_nursery() as group:
            for i, peer in enumerate(peers):
                group.start_soon(step, peer, i * B)
    assert {peer.trainer.step for peer in peers} == {1}
    assert rejoined.trainer.lineage == survivors[0].trainer.lineage
    assert reported_discards(reporter) == [(1, 5)]  # none of them is the run's: the run redid 1 only
    assert Reporter(RUN, ME, None, tmp_path).lineage == {}  # reported once: a later restart does not again


async def test_earlier_steps_are_discarded_when_a_micro_batch_came_before_the_download(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    discarded, _ = await rejoin(nursery, {1: None, 2: other(2), 3: other(3)}, tmp_path, computed_first=True)
    assert discarded == [(2, 3)]  # as without the micro-batch: its initial state was never the run's step 3
