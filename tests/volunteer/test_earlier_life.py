"""A restarted volunteer whose earlier process's steps were taken again differently after a rollback
reports them discarded (volunteer.collab.sync, "A restarted volunteer"; shared.state.lineage, "An earlier
life"), so the ledger stops crediting them.

What the two-backbone soak hit: volunteer2 held step 9 and was killed; the run resumed from a backbone's
checkpoint of step 1 and the survivors took steps 2 and 3 again. volunteer2 restarted and loaded the new
step 3: it reported only the steps above 3 discarded, and its lost steps 2 and 3 (another history than the
new ones) stayed credited. Here real peers take steps 1..3; a restarted peer's report journal (a real
:class:`~volunteer.reporting.Reporter` in its data dir) holds its earlier process's steps with their
fingerprints, and it downloads the survivors' step 3 over loopback.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio

from protocols.ledger import ContributionReport
from shared.auth.keys import Identity
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
    nursery: trio.Nursery, earlier: dict[int, bytes | None], data_dir: Path
) -> tuple[list[tuple[int, int]], dict[int, bytes]]:
    """Two peers take steps 1..3; a peer restarted in ``data_dir``, whose earlier process journaled the
    steps ``earlier`` (step -> fingerprint; None: the survivors' fingerprint at that step), downloads
    their step 3. Returns the ranges its next report lists as discarded, and its lineage after."""
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

    earlier_life = Reporter(RUN, ME, None, data_dir, interval=1e9)
    for number, fingerprint in earlier.items():
        earlier_life.record(JournaledStep(number, B, 0.1, 0, float(number)), fingerprint or survivors[number])
    earlier_life.journal.close()  # killed: the next process replays its journal

    reporter = Reporter(RUN, ME, None, data_dir, interval=1e9)
    assert reporter.last_step == max(earlier)
    trainer = LocalTrainer(LinearTask(), training, RUN)  # type: ignore[arg-type]
    rejoined = CollaborativeOptimizer(
        nodes[2],
        trainer,
        training,
        config=CONFIG,
        previous_life=reporter.last_step or None,
        previous_lineage=reporter.lineage,
        on_discard=reporter.discard,
    )
    await nursery.start(rejoined.run)
    await rejoined.refresh_view()
    with trio.fail_after(30):
        assert await rejoined.sync_state() == 3
    assert rejoined.trainer.lineage[3] == survivors[3]
    reporter.close_interval()
    discarded = [
        (r.first, r.last)
        for signed, _ in reporter._pending
        for r in msgspec.msgpack.decode(signed.report, type=ContributionReport).discarded
    ]
    return discarded, Reporter(RUN, ME, None, data_dir).lineage


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
