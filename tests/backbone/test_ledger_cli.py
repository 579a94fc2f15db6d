"""`backbone ledger`: the leaderboard (compute and online time, aggregation, flags and why), `--flags`
(each flagged report), and `--steps [--last N]` (the run's recent global steps, each batch against the
target, and its loss curve)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backbone.cli import LossPoint, app, loss_curve, sparkline
from backbone.ledger import LedgerStore, StepRow

runner = CliRunner()
T0 = 1_700_000_000.0


def record_falling_loss(data_dir: Path, steps: int) -> None:
    """Steps 1..steps, two seconds apart, loss 7 - step / 10 (step 5's loss unknown), batch 128 of a
    target 120 (step 7: 240)."""
    with LedgerStore.open(f"sqlite:///{data_dir / 'ledger.sqlite3'}") as store:
        for step in range(1, steps + 1):
            loss = None if step == 5 else 7 - step / 10
            samples = 240 if step == 7 else 128
            store.record_step(
                step, finished_at=T0 + 2 * step, loss=loss, samples=samples, peers=3, target_batch=120
            )


def ledger(data_dir: Path, *extra: str) -> tuple[int, str]:
    result = runner.invoke(app, ["ledger", "--data-dir", str(data_dir), *extra])
    return result.exit_code, result.output


def row(step: int, loss: float | None) -> StepRow:
    return StepRow(step, T0 + step, loss, 128, 3)


def test_loss_curve_means_evenly_sized_buckets_in_step_order() -> None:
    steps = [row(s, float(s)) for s in range(10, 0, -1)]  # newest first, as the store returns them

    curve = loss_curve(steps, 3)

    assert curve == [LossPoint(1, 3, 2.0), LossPoint(4, 6, 5.0), LossPoint(7, 10, 8.5)]


def test_loss_curve_skips_steps_without_a_loss_and_has_at_most_one_point_per_step() -> None:
    steps = [row(1, 6.0), row(2, None), row(3, 5.0)]

    assert loss_curve(steps, 8) == [LossPoint(1, 1, 6.0), LossPoint(3, 3, 5.0)]
    assert loss_curve([row(1, None)], 8) == []
    with pytest.raises(ValueError, match="at least one point"):
        loss_curve(steps, 0)


def test_sparkline_scales_between_the_smallest_and_largest_value() -> None:
    assert sparkline([6.0, 5.0, 4.0]) == "█▅▁"
    assert sparkline([2.0, 2.0]) == "▅▅"
    assert sparkline([]) == ""


def test_ledger_steps_json_lists_the_last_steps_oldest_first_and_the_falling_curve(tmp_path: Path) -> None:
    record_falling_loss(tmp_path, 40)

    code, output = ledger(tmp_path, "--steps", "--last", "3", "--json")

    assert code == 0, output
    shown = json.loads(output)
    assert [s["global_step"] for s in shown["steps"]] == [38, 39, 40]
    assert shown["steps"][-1] == {
        "global_step": 40,
        "finished_at": T0 + 80,
        "loss": pytest.approx(3.0),
        "samples": 128,
        "peers": 3,
        "source": "tracker",
        "target_batch": 120,
        "eval_loss": None,
        "eval_users": 0,
    }
    assert (shown["median_batch"], shown["target_batch"]) == (128, 120)
    assert shown["curve_steps"] == 40
    curve = shown["curve"]
    assert len(curve) == 8
    assert curve[0]["first_step"] == 1 and curve[-1]["last_step"] == 40
    losses = [point["loss"] for point in curve]
    assert losses == sorted(losses, reverse=True)  # the loss fell


def test_ledger_steps_table_shows_steps_the_sparkline_and_first_and_last_loss(tmp_path: Path) -> None:
    record_falling_loss(tmp_path, 12)

    code, output = ledger(tmp_path, "--steps", "--last", "10")

    assert code == 0, output
    assert "the last 10 of 12 recorded" in output
    assert "2023-11-14 22:13:44 UTC" in output  # step 12 at T0 + 24
    assert "—" in output  # step 5 has no loss
    assert "128 / 120" in output and "240 / 120" in output
    assert "median batch of these steps: 128 / target 120 (1.07x)" in output
    assert "▁" in output and "█" in output
    assert "loss at step 1: 6.9000; at step 12: 5.8000" in output


def test_ledger_steps_says_when_no_step_has_a_loss(tmp_path: Path) -> None:
    LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").close()

    code, output = ledger(tmp_path, "--steps")

    assert code == 0, output
    assert "no step has a recorded loss yet" in output


def test_ledger_without_steps_still_prints_the_leaderboard(tmp_path: Path) -> None:
    record_falling_loss(tmp_path, 3)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        store.add_user("alice", now=T0)

    code, output = ledger(tmp_path, "--json")

    assert code == 0, output
    assert [r["username"] for r in json.loads(output)] == ["alice"]


def test_ledger_steps_refuses_a_count_below_one(tmp_path: Path) -> None:
    record_falling_loss(tmp_path, 3)

    code, _ = ledger(tmp_path, "--steps", "--last", "0")

    assert code == 2


def test_ledger_steps_refuses_an_absurd_count_without_a_traceback(tmp_path: Path) -> None:
    """`--last 10**20` overflowed SQLite's integer inside the query: a 30-line traceback (review)."""
    record_falling_loss(tmp_path, 3)

    code, output = ledger(tmp_path, "--steps", "--last", str(10**20))

    assert code == 2
    assert "Traceback" not in output and "--last" in output


def test_ledger_steps_works_as_the_readme_writes_it(tmp_path: Path) -> None:
    """Issue 11: `backbone ledger --data-dir ~/bb --steps` failed ("requires an argument")."""
    record_falling_loss(tmp_path, 30)

    code, output = ledger(tmp_path, "--steps")
    assert code == 0, output
    assert "the last 20 of 30 recorded" in output
    code, output = ledger(tmp_path, "--last", "4")  # --last alone means the steps view
    assert code == 0, output
    assert "the last 4 of 30 recorded" in output
    code, output = ledger(tmp_path, "--steps", "--flags")
    assert code == 2 and "two views" in output


def test_ledger_shows_why_reports_were_flagged_in_text_and_json(tmp_path: Path) -> None:
    from .ledger.reports import identity, make_report, sign

    laptop = identity(21)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        store.add_user("alice", now=T0)
        secret = store.create_invite("alice", now=T0)
        store.redeem_invite(secret, laptop.peer_id, laptop.public_key_bytes, now=T0)
        for seq, report in enumerate(
            [
                make_report(laptop, 0, start=T0 - 10**9, length=10**9),  # before_join, too_long
                make_report(laptop, 1, start=T0, length=7200),  # too_long
                make_report(laptop, 2, start=T0, length=60),  # within bounds
                make_report(laptop, 3, start=T0 + 30, length=60),  # overlap
            ]
        ):
            assert store.assess_and_record(sign(laptop, report), report, now=T0 + 7200 + seq) is not None

    code, output = ledger(tmp_path, "--json")
    assert code == 0, output
    [alice] = json.loads(output)
    assert alice["flagged_reports"] == 3
    assert alice["flag_reasons"] == {"before_join": 1, "overlap": 1, "too_long": 2}
    code, output = ledger(tmp_path)
    assert code == 0, output
    assert "flagged reports of alice: 3 (before_join 1, overlap 1, too_long 2)" in output
    assert f"each flagged report and why: backbone ledger --data-dir {tmp_path} --flags" in output

    code, output = ledger(tmp_path, "--flags", "--json")
    assert code == 0, output
    listed = json.loads(output)
    assert [(r["seq"], r["codes"]) for r in listed] == [
        (3, ["overlap"]),
        (1, ["too_long"]),
        (0, ["before_join", "too_long"]),
    ]
    assert all(r["username"] == "alice" and r["reason"] for r in listed)
    code, output = ledger(tmp_path, "--flags")
    assert code == 0, output
    assert "overlaps the previous report" in output and "before the peer joined" in output


def test_ledger_shows_a_relayed_column_once_a_relay_is_credited(tmp_path: Path) -> None:
    """Issue 14: relaying is credited (what other users' peers received through the relay), and shown."""
    from .ledger.reports import identity, make_report, sign

    relay, client = identity(33), identity(34)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        for name, machine in (("rita", relay), ("carl", client)):
            store.add_user(name, now=T0)
            secret = store.create_invite(name, now=T0)
            store.redeem_invite(secret, machine.peer_id, machine.public_key_bytes, now=T0)
        claim = make_report(relay, 0, start=T0, length=60, samples=0, bytes_relayed=9_000_000)
        evidence = make_report(client, 0, start=T0, length=60, samples=0, relayed={relay.peer_id: 2_500_000})
        for who, report in ((relay, claim), (client, evidence)):
            assert store.assess_and_record(sign(who, report), report, now=T0 + 100) is not None

    code, output = ledger(tmp_path)

    assert code == 0, output
    assert "relayed" in output
    [rita] = [line for line in output.splitlines() if line.strip().startswith("rita")]
    assert "2.5 MB" in rita  # min(claimed 9 MB, 2.5 MB received by carl)
    code, output = ledger(tmp_path, "--json")
    assert {r["username"]: r["bytes_relayed"] for r in json.loads(output)} == {"carl": 0, "rita": 2_500_000}


def test_allow_add_refuses_the_backbones_username(tmp_path: Path) -> None:
    # finding 11: adding then removing 'backbone' revoked every backbone's own token
    (tmp_path / "run.json").write_text(
        '{"run_id": "r@x", "api": ["https://h:1"], "authority_public_key": ""}'
    )
    result = runner.invoke(app, ["allow", "add", "backbone", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "reserved" in result.output
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        assert store.list_users() == []


def test_ledger_shows_compute_and_online_time_and_aggregation_in_readable_units(tmp_path: Path) -> None:
    """Issue 11: "compute h 0.00" for volunteers that trained minutes, "aggregated 0.0 MB" for kilobytes,
    and a "relayed 0.0 MB" column while nobody's relaying is credited."""
    from protocols.receipts import PulledSlice

    from .ledger.reports import identity, make_report, receipt, sign

    laptop, server = identity(31), identity(32)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        for name, machine in (("alice", laptop), ("bob", server)):
            store.add_user(name, now=T0)
            secret = store.create_invite(name, now=T0)
            store.redeem_invite(secret, machine.peer_id, machine.public_key_bytes, now=T0)
        assert store.session_heartbeat(laptop.peer_id, "a" * 32, "127.0.0.1", now=T0)
        assert store.leave_session(laptop.peer_id, "a" * 32, now=T0 + 180)  # three minutes in the run
        store.record_step(1, finished_at=T0 + 60, loss=5.0, samples=96, peers=2, target_batch=96)
        mine = make_report(
            laptop, 0, start=T0, length=120, samples=48, compute_seconds=2.5, bytes_aggregated=49_572,
            receipts=[receipt(server, laptop, 1, 48)],
        )  # fmt: skip
        theirs = make_report(server, 0, start=T0, length=120, pulled=[PulledSlice(laptop.peer_id, 1, 49_572)])
        for who, report in ((laptop, mine), (server, theirs)):
            assert store.assess_and_record(sign(who, report), report, now=T0 + 200) is not None

    code, output = ledger(tmp_path)

    assert code == 0, output
    [alice] = [line for line in output.splitlines() if line.strip().startswith("alice")]
    assert alice.split()[1:5] == ["48", "2.5", "s", "3.0"]  # samples, compute 2.5 s, online 3.0 min
    assert "49.6 kB" in alice  # bob pulled alice's slice after her last report: credited all the same
    assert "relayed" not in output
    code, output = ledger(tmp_path, "--json")
    [row] = [r for r in json.loads(output) if r["username"] == "alice"]
    assert row["online_hours"] == pytest.approx(180 / 3600)
    assert row["compute_hours"] == pytest.approx(2.5 / 3600)
    assert row["bytes_aggregated"] == 49_572


def test_ledger_says_a_swarm_runs_samples_are_stage_samples(tmp_path: Path) -> None:
    """Issue 17 item 6: a swarm run's credit is in stage-samples; the leaderboard says so (only then)."""
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        store.add_user("alice", now=T0)
    code, output = ledger(tmp_path)
    assert code == 0 and "stage-samples" not in output, output
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        for stage in (0, 1, 2):
            store.record_stage_step(stage, 1, finished_at=T0, loss=None, samples=16, peers=2, target_batch=16)
    code, output = ledger(tmp_path)
    assert code == 0, output
    assert "a swarm run of 3 stages: samples are stage-samples" in " ".join(output.split())


def test_ledger_steps_of_a_swarm_run_lists_its_stages_steps(tmp_path: Path) -> None:
    """A swarm run takes no global step: ``--steps`` shows each stage's recorded steps instead of an empty
    table of global steps."""
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        for stage, steps in ((0, 3), (1, 5), (2, 4)):
            for step in range(1, steps + 1):
                store.record_stage_step(
                    stage,
                    step,
                    finished_at=T0 + step,
                    loss=None,
                    samples=16 + stage,
                    peers=2,
                    target_batch=16,
                )
    code, output = ledger(tmp_path, "--steps", "--last", "2")
    assert code == 0, output
    text = " ".join(output.split())
    assert "the steps of its 3 stages (no global step)" in text, output
    cells = [line.replace("│", " ").split() for line in output.splitlines() if line.startswith("│")]
    # stage, steps recorded, last step, median batch of the last 2, target
    assert cells == [["0", "3", "3", "16", "16"], ["1", "5", "5", "17", "16"], ["2", "4", "4", "18", "16"]]
