"""`backbone allow add` (issue 11, items 6-7): it works on a fresh data dir once told the run and its API
URL, says the exact command when not, limits an invite's uses, and refuses a run id of another run.
(The exit codes and one-line errors of real processes: ``tests/system/test_invite_cli.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backbone.cli import app
from backbone.ledger import LedgerStore
from protocols.api import decode_invite

runner = CliRunner()
URL = "https://127.0.0.1:8443"


def allow_add(data_dir: Path, *extra: str, user: str = "alice") -> tuple[int, str]:
    result = runner.invoke(app, ["allow", "add", user, "--data-dir", str(data_dir), *extra])
    return result.exit_code, " ".join(result.output.split())  # unwrapped: what matters is the text


def test_allow_add_on_a_fresh_data_dir_says_the_full_command_and_creates_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "bb"
    code, output = allow_add(data_dir)
    assert code == 2
    assert "holds no run yet" in output
    assert f"`backbone allow add alice --data-dir {data_dir} --run-id my-run --public-url https://" in output
    code, output = allow_add(data_dir, "--run-id", "mine")  # what was given is kept in the command
    assert code == 2 and "--run-id mine --public-url https://" in output
    code, output = allow_add(data_dir, "--public-url", URL)
    assert code == 2 and f"--run-id my-run --public-url {URL}`" in output
    assert not data_dir.exists()


def test_allow_add_on_a_fresh_data_dir_makes_the_run_and_says_how_to_start_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "bb"
    code, output = allow_add(data_dir, "--run-id", "inv", "--public-url", URL, "--max-uses", "1")
    assert code == 0, output
    assert "at most 1 machine;" in output
    invite = next(word for word in output.split() if word.startswith("dli1_"))
    pinned = decode_invite(invite)
    assert pinned.run_id.startswith("inv@") and pinned.api == [URL]
    assert f"they join with: volunteer join --invite {invite}" in output
    assert (
        f"start the run with: backbone start --run-id {pinned.run_id} --data-dir {data_dir} "
        f"--api-listen 0.0.0.0:8443 --public-url {URL}"
    ) in output
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert (data_dir / "authority.key").stat().st_mode & 0o777 == 0o600
    # the data dir holds the run now: more invites need no --run-id (its name or full id may be given)
    for extra in ([], ["--run-id", "inv"], ["--run-id", pinned.run_id]):
        code, output = allow_add(data_dir, *extra, "--json", user="bob")
        assert code == 0, output
        answer = json.loads(output)
        assert answer["run_id"] == pinned.run_id and answer["max_uses"] is None
        assert decode_invite(answer["invite"]).api == [URL]
        assert "start the run with" not in output
    with LedgerStore.open(f"sqlite:///{data_dir / 'ledger.sqlite3'}") as store:
        assert [u.username for u in store.list_users()] == ["alice", "bob"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--run-id", "other"], "holds run inv@"),
        (["--public-url", "http://127.0.0.1:1"], "is not an https://HOST[:PORT] URL"),
        (["--public-url", "https://127.0.0.1:x"], "has an invalid port"),
        (["--max-uses", "0"], "--max-uses"),
        (["--max-uses", "2000000"], "--max-uses"),  # refused before the user is added (review)
        (["--expires-in-days", "0"], "--expires-in-days must be positive, got 0.0 (leave it out"),
        (["--expires-in-days", "-1"], "--expires-in-days must be positive"),
    ],
)
def test_allow_add_refuses_unusable_input_with_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    assert allow_add(tmp_path / "bb", "--run-id", "inv", "--public-url", URL)[0] == 0
    code, output = allow_add(tmp_path / "bb", *extra, user="carol")
    assert code == 2 and message in output, output
    with LedgerStore.open(f"sqlite:///{tmp_path / 'bb' / 'ledger.sqlite3'}") as store:
        assert [u.username for u in store.list_users()] == ["alice"]  # nothing written for carol


def test_the_cli_and_the_ledger_bound_an_invites_uses_alike() -> None:
    from backbone import cli
    from backbone.ledger import store

    assert cli.MAX_INVITE_USES == store.MAX_INVITE_USES


def test_ledger_and_allow_on_a_dir_that_holds_no_run_refuse_and_create_nothing(tmp_path: Path) -> None:
    """A mistyped --data-dir used to look like an empty run, and got a ledger created in it (review)."""
    for args in (["ledger"], ["allow", "list"], ["allow", "remove", "alice"]):
        result = runner.invoke(app, [*args, "--data-dir", str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert "is not a backbone data dir" in result.output
    assert list(tmp_path.iterdir()) == []


def test_allow_add_public_url_replaces_the_urls_of_this_invite_only(tmp_path: Path) -> None:
    assert allow_add(tmp_path / "bb", "--run-id", "inv", "--public-url", URL)[0] == 0
    other = "https://bb.example.org:443"
    code, output = allow_add(tmp_path / "bb", "--public-url", other, "--json", user="dave")
    assert code == 0 and decode_invite(json.loads(output)["invite"]).api == [other]
    code, output = allow_add(tmp_path / "bb", "--json", user="erin")
    assert code == 0 and decode_invite(json.loads(output)["invite"]).api == [URL]


def test_allow_remove_and_list_name_the_next_step(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["allow", "list", "--data-dir", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "give the --data-dir of `backbone start`" in missing.output
    assert allow_add(tmp_path / "bb", "--run-id", "inv", "--public-url", URL)[0] == 0
    result = runner.invoke(app, ["allow", "remove", "zed", "--data-dir", str(tmp_path / "bb")])
    output = " ".join(result.output.split())
    assert result.exit_code == 1
    assert f"no active user 'zed'; the users are: backbone allow list --data-dir {tmp_path / 'bb'}" in output
