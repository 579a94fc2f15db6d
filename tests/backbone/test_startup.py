"""What `backbone start` checks before it touches anything: the API address, public URLs, the authority key,
and which run a data dir holds (backbone.startup, backbone.runinfo)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backbone.cli import app
from backbone.runinfo import RunInfo, check_held_run, held_run_conflict, write_run_info
from backbone.startup import bind_api, check_authority_key, check_public_url, parse_api_listen
from shared.errors import ConfigError

HELD = RunInfo(run_id="my-run@4fT9abc", api=["https://127.0.0.1:8443"], authority_public_key="ab" * 32)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0.0.0.0:8443", ("0.0.0.0", 8443)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9000", ("::1", 9000))],
)
def test_parse_api_listen_reads_an_ip_and_a_port(text: str, parsed: tuple[str, int]) -> None:
    assert parse_api_listen(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nonsense", "is not HOST:PORT"),
        ("8443", "is not HOST:PORT"),
        ("localhost:8443", "'localhost' is not an IP address"),
        ("0.0.0.0:http", "the port must be 0 to 65535"),
        ("0.0.0.0:70000", "the port must be 0 to 65535"),
        ("0.0.0.0:-1", "the port must be 0 to 65535"),
    ],
)
def test_parse_api_listen_refuses_what_hypercorn_would_misread(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_api_listen(text)


def test_bind_api_claims_the_port_and_a_taken_port_is_one_line_naming_the_next_step() -> None:
    with bind_api("127.0.0.1:0") as first:
        port = first.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            bind_api(f"127.0.0.1:{port}")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the first socket listens: the API can serve it later
    assert str(caught.value) == (
        f"cannot serve the API on 127.0.0.1:{port}: the port is in use by another process; "
        "choose another port (or 0 for any free one)"
    )


def test_bind_api_refuses_an_address_this_machine_does_not_have() -> None:
    with pytest.raises(ConfigError, match="not one of this machine's"):
        bind_api("192.0.2.1:0")  # TEST-NET-1: never assigned


@pytest.mark.parametrize(
    "url", ["https://bb1.example.org:8443", "https://203.0.113.7:8443/", "https://[::1]:1"]
)
def test_check_public_url_accepts_https_urls(url: str) -> None:
    assert check_public_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "ftp:/x",
        "http://bb1:8443",
        "https://",
        "bb1:8443",
        "https://bb1:99999",
        "https://bb1:0",
        "https://b?x=1",
    ],
)
def test_check_public_url_refuses_what_volunteers_could_not_use(url: str) -> None:
    with pytest.raises(ConfigError, match="--public-url"):
        check_public_url(url)


def test_check_authority_key_wants_an_existing_file(tmp_path: Path) -> None:
    check_authority_key(None)
    key = tmp_path / "authority.key"
    key.write_text("x")
    check_authority_key(key)
    with pytest.raises(ConfigError, match=r"does not exist: copy the run's authority\.key"):
        check_authority_key(tmp_path / "authority.kye")
    with pytest.raises(ConfigError, match="is not a file"):
        check_authority_key(tmp_path)


@pytest.mark.parametrize("requested", ["my-run", "my-run@4fT9abc"])
def test_a_data_dir_serves_its_own_run_by_name_or_full_id(requested: str) -> None:
    assert held_run_conflict(HELD, requested) is None
    assert held_run_conflict(HELD, requested, authority_public_key="ab" * 32) is None


@pytest.mark.parametrize(
    ("requested", "open_run", "key", "message"),
    [
        ("my-rnu", False, None, "holds run my-run@4fT9abc, not my-rnu (invites carry that id)"),
        ("other@4fT9abc", False, None, "holds run my-run@4fT9abc, not other@4fT9abc"),
        ("my-run@XXXX", False, None, "holds run my-run@4fT9abc, not my-run@XXXX"),
        ("my-run", True, None, "holds the pinned run my-run@4fT9abc, so it cannot serve an open run"),
        ("my-run@other", False, "cd" * 32, "the authority key given is not the one of run my-run@4fT9abc"),
    ],
)
def test_a_data_dir_refuses_another_run(
    requested: str, open_run: bool, key: str | None, message: str
) -> None:
    conflict = held_run_conflict(HELD, requested, open_run=open_run, authority_public_key=key)
    assert conflict is not None and message in conflict
    assert "start it with --run-id my-run" in conflict or "use that run's authority.key" in conflict


def test_check_held_run_reads_run_json_and_a_fresh_data_dir_holds_nothing(tmp_path: Path) -> None:
    assert check_held_run(tmp_path, "anything") is None
    write_run_info(tmp_path, HELD)
    assert check_held_run(tmp_path, "my-run") == HELD
    with pytest.raises(ConfigError, match=f"^{tmp_path}: this data dir holds run my-run@4fT9abc, not my-rnu"):
        check_held_run(tmp_path, "my-rnu")
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(ConfigError, match="is damaged"):
        check_held_run(tmp_path, "my-run")


# ---------------------------------------------------------------- the command, in-process

NOISY_LOGGERS = ("zeroconf", "shared.net.rpc", "hpack", "httpx")  # shared.console.setup_logging quiets them
START = ["start", "--run-id", "r", "--listen", "/ip4/127.0.0.1/tcp/0", "--api-listen", "127.0.0.1:0"]


@pytest.fixture
def own_logging() -> Iterator[None]:
    """The command sets up logging for its process; give the test process's set-up back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)


def start(data_dir: Path, *extra: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, [*START, "--no-mdns", "--data-dir", str(data_dir), *extra])
    return result.exit_code, result.output.splitlines()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--api-listen", "nonsense"), "--api-listen 'nonsense' is not HOST:PORT"),
        (("--public-url", "ftp://bb1"), "--public-url 'ftp://bb1': give the API's https://HOST:PORT"),
        (("--authority-key", "/nonexistent/authority.key"), "copy the run's authority.key"),
        (("--manifest", "/nonexistent/run.toml"), "cannot read manifest /nonexistent/run.toml"),
        (("--listen", "/dns4/example.com/tcp/0"), "give an IP address"),
        (("--public-url", "https://a:1") * 9, "give at most 8 --public-url"),
        (("--aggregate-bandwidth", "0"), "--aggregate-bandwidth must be in (0, 1e7] MB/s"),
    ],
)
@pytest.mark.usefixtures("own_logging")
def test_start_refuses_bad_input_in_one_line_before_touching_the_data_dir(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    code, lines = start(tmp_path / "d", *extra)
    assert code == 2
    (line,) = lines
    assert message in line
    assert not (tmp_path / "d").exists()


@pytest.mark.usefixtures("own_logging")
def test_start_with_a_database_url_it_cannot_use_is_one_line_and_creates_no_key(tmp_path: Path) -> None:
    code, lines = start(tmp_path / "d", "--database-url", "foo://x")
    assert code == 2
    assert lines == [
        "error: --database-url: unsupported database 'foo'; use sqlite:///PATH or postgresql+psycopg://..."
    ]
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["lock"]


@pytest.mark.usefixtures("own_logging")
def test_start_without_shards_to_serve_exits_2_before_announcing(tmp_path: Path) -> None:
    manifest = tmp_path / "run.toml"
    manifest.write_text('[dataset]\nsource = "backbone"\ngenerate = 0\nfiles = ["mine-*.jsonl"]\n')
    code, lines = start(tmp_path / "d", "--manifest", str(manifest))
    assert code == 2
    (line,) = lines  # no "listening on" before it
    assert (
        "holds no .jsonl shard matching mine-*.jsonl: put the run's shards there, or set dataset.generate"
        in line
    )
    assert not (tmp_path / "d" / "run.json").exists()


@pytest.mark.usefixtures("own_logging")
def test_start_never_makes_a_new_authority_key_for_a_run_the_data_dir_holds(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    write_run_info(data_dir, RunInfo(run_id="r@4fT9abc", api=[], authority_public_key="ab" * 32))
    code, lines = start(data_dir)
    assert code == 2
    assert lines == [
        f"error: {data_dir} holds run r@4fT9abc but not its authority.key: give that run's key with "
        "--authority-key PATH, or copy it into the data dir"
    ]
    assert not (data_dir / "authority.key").exists()
