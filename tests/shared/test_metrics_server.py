"""The volunteer's /metrics server (:mod:`shared.metrics_server`) on real loopback sockets: the answers
by path and method, and that nothing a client sends -- garbage, an oversized head, a slow trickle, a
hang-up -- stops it from answering the next scrape."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from shared import metrics_server
from shared.errors import ConfigError
from shared.metrics_server import (
    MAX_HEAD_BYTES,
    is_loopback,
    parse_listen,
    parse_request_head,
    serve_metrics,
)
from shared.prometheus import CONTENT_TYPE

PAGE = "# HELP dedloc_volunteer_x x\n# TYPE dedloc_volunteer_x gauge\ndedloc_volunteer_x 1\n"


async def _raw(port: int, data: bytes, *, half_close: bool = True) -> bytes:
    """Send ``data`` to the server and read its whole answer (it closes the connection)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
            if half_close:
                await stream.send_eof()
        except trio.BrokenResourceError:
            pass  # the server answered and closed before taking it all
        answer = bytearray()
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return bytes(answer)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def _serving(nursery: trio.Nursery, page: Callable[[], str] = lambda: PAGE) -> int:
    port: int = await nursery.start(serve_metrics, "127.0.0.1", 0, page)
    return port


async def _scrape(port: int) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{port}/metrics", timeout=10)


@pytest.fixture
async def port(nursery: trio.Nursery) -> int:
    return await _serving(nursery)


async def test_get_metrics_answers_the_page_as_prometheus_text(port: int) -> None:
    response = await _scrape(port)
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert response.text == PAGE
    async with httpx.AsyncClient() as client:  # a query string (some scrapers add one) is ignored
        again = await client.get(f"http://127.0.0.1:{port}/metrics?x=1", timeout=10)
    assert again.status_code == 200 and again.text == PAGE


async def test_other_paths_are_404_and_other_methods_405(port: int) -> None:
    async with httpx.AsyncClient() as client:
        base = f"http://127.0.0.1:{port}"
        assert (await client.get(base + "/", timeout=10)).status_code == 404
        assert (await client.get(base + "/metricsx", timeout=10)).status_code == 404
        posted = await client.post(base + "/metrics", content=b"x=1", timeout=10)
        assert posted.status_code == 405 and posted.headers["allow"] == "GET"
        assert (await client.delete(base + "/metrics", timeout=10)).status_code == 405


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\r\n\r\n",
        b"\x00\xff\xfe garbage \x80\r\n\r\n",
        b"GET /metrics\r\n\r\n",  # HTTP/0.9: no version
        b"GET  /metrics HTTP/1.1\r\n\r\n",
        b"get /metrics HTTP/1.1\r\n\r\n",
        b"GET metrics HTTP/1.1\r\n\r\n",
        b"GET /m\xc3\xa9trics HTTP/1.1\r\n\r\n",
    ],
)
async def test_garbage_gets_400_and_the_server_answers_on(port: int, garbage: bytes) -> None:
    answer = await _raw(port, garbage)
    assert _status(answer) == 400, answer
    assert (await _scrape(port)).status_code == 200


async def test_an_oversized_head_gets_431_without_being_read_whole(port: int) -> None:
    huge = b"GET /metrics HTTP/1.1\r\nX-Junk: " + b"a" * (4 * MAX_HEAD_BYTES)
    answer = await _raw(port, huge, half_close=False)
    assert _status(answer) == 431, answer[:200]
    assert (await _scrape(port)).status_code == 200


async def test_a_slow_client_is_timed_out_and_others_are_served_meanwhile(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_server, "REQUEST_TIMEOUT", 0.5)
    port = await _serving(nursery)
    slow = await trio.open_tcp_stream("127.0.0.1", port)
    async with slow:
        await slow.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends its head
        assert (await _scrape(port)).status_code == 200  # served while the slow one waits
        started = trio.current_time()
        answer = bytearray()
        with trio.fail_after(5):
            while chunk := await slow.receive_some(4096):
                answer += chunk
        assert _status(bytes(answer)) == 408
        assert 0.3 < trio.current_time() - started < 3


async def test_too_many_connections_are_closed_at_once_not_queued(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(metrics_server, "REQUEST_TIMEOUT", 30.0)
    port = await _serving(nursery)
    idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
    await trio.sleep(0.2)  # both accepted: they hold the two slots
    extra = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(5):
        with contextlib.suppress(trio.BrokenResourceError):  # reset, or ...
            assert await extra.receive_some(10) == b""  # ... closed without an answer
    for stream in [*idle, extra]:
        await stream.aclose()
    await trio.sleep(0.2)
    assert (await _scrape(port)).status_code == 200  # the slots came back


async def test_a_page_that_fails_to_render_is_a_500_not_a_crash(nursery: trio.Nursery) -> None:
    def broken() -> str:
        raise RuntimeError("a bug")

    port = await _serving(nursery, broken)
    response = await _scrape(port)
    assert response.status_code == 500
    assert (await _scrape(port)).status_code == 500  # and it still answers


async def test_a_taken_port_is_a_config_error(nursery: trio.Nursery, port: int) -> None:
    with pytest.raises(ConfigError, match="cannot serve metrics"):
        await nursery.start(serve_metrics, "127.0.0.1", port, lambda: PAGE)


@given(st.binary(max_size=300))
def test_parse_request_head_accepts_or_raises_value_error_only(data: bytes) -> None:
    try:
        method, path = parse_request_head(data)
    except ValueError:
        return
    assert method.isalpha() and path.startswith("/") and "?" not in path


def test_parse_request_head_reads_method_and_path() -> None:
    assert parse_request_head(b"GET /metrics?a=b HTTP/1.1\r\nHost: x\r\n\r\n") == ("GET", "/metrics")
    assert parse_request_head(b"POST /x HTTP/1.0\n\n") == ("POST", "/x")


def test_parse_listen_defaults_to_loopback_and_takes_explicit_hosts() -> None:
    assert parse_listen("9101") == ("127.0.0.1", 9101)
    assert parse_listen("localhost:9101") == ("127.0.0.1", 9101)
    assert parse_listen("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_listen("[::1]:9101") == ("::1", 9101)
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    for bad in ["", "host:9101", "127.0.0.1:", "127.0.0.1:70000", "::1:9101", "1.2.3.4:-1", "127.0.0.1:x"]:
        with pytest.raises(ConfigError, match="--metrics-listen"):
            parse_listen(bad)
