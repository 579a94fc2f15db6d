"""``POST evaluations`` and the held-out shards (``GET heldout``) of the backbone's API app in this process
(issue 12 item 7): a member's signed evaluation is recorded and answered with the step's cross-checked loss;
bad, malformed, replayed and lying ones get a 4xx, never a 5xx; the held-out shard is never in the
training listing."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ratelimit import RateLimiter
from protocols.api import ShardList
from protocols.evaluation import MAX_STEPS_AHEAD, Evaluation, SignedEvaluation, evaluation_payload
from shared.auth.keys import Identity
from shared.data.heldout import HELDOUT_SHARD, heldout_digest, read_heldout, write_heldout

from .api_app import InProcessApi, in_process_api, run

STEP = 4


def held_out(data_dir: Path) -> str:
    """Write the synthetic held-out shard (256 examples, the default ``eval_examples``); its digest."""
    path = write_heldout(data_dir / "shards" / "heldout", 256, 0)
    return heldout_digest(read_heldout([path], 256))


def evaluation(api: InProcessApi, digest: str, **fields: object) -> Evaluation:
    values: dict[str, object] = {
        "run_id": api.state.run_id,
        "peer_id": api.member.peer_id,
        "step": STEP,
        "params": b"\x07" * 8,
        "loss": 3.5,
        "examples": 256,
        "eval_set": digest,
        "timestamp": time.time(),
    }
    values.update(fields)
    return Evaluation(**values)  # type: ignore[arg-type]


def sign(who: Identity, value: Evaluation) -> dict[str, object]:
    data = msgspec.msgpack.encode(value)
    return msgspec.to_builtins(SignedEvaluation(data, who.sign(evaluation_payload(data))))  # type: ignore[no-any-return]


async def post(api: InProcessApi, body: object) -> tuple[int, dict[str, object]]:
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    response = await api.request("POST", "evaluations", content=content)
    return response.status_code, response.json()


def test_a_members_evaluation_is_recorded_and_a_replay_is_refused(tmp_path: Path) -> None:
    digest = held_out(tmp_path)
    with in_process_api(tmp_path) as api:
        api.state.store.record_step(STEP, finished_at=time.time(), loss=4.0, samples=64, peers=1)

        async def main() -> None:
            body = sign(api.member, evaluation(api, digest))
            assert await post(api, body) == (200, {"step": STEP, "loss": 3.5, "users": 1, "agrees": True})
            status, answer = await post(api, body)
            assert (status, answer["error"]) == (409, "duplicate")

        run(main)
        [row] = api.state.store.recent_steps()
        assert (row.eval_loss, row.eval_users) == (3.5, 1)


@pytest.mark.parametrize(
    ("fields", "status", "code"),
    [
        ({"step": STEP + MAX_STEPS_AHEAD + 1}, 422, "future_step"),
        ({"examples": 100}, 422, "wrong_examples"),
        ({"eval_set": "0" * 64}, 422, "wrong_eval_set"),
        ({"timestamp": time.time() - 3600}, 401, "clock_skew"),
        ({"run_id": "another-run"}, 404, "unknown_run"),
    ],
)
def test_an_evaluation_breaking_a_bound_is_refused(
    tmp_path: Path, fields: dict[str, object], status: int, code: str
) -> None:
    digest = held_out(tmp_path)
    with in_process_api(tmp_path) as api:
        api.state.store.record_step(STEP, finished_at=time.time(), loss=4.0, samples=64, peers=1)

        async def main() -> None:
            got, answer = await post(api, sign(api.member, evaluation(api, digest, **fields)))
            assert (got, answer["error"]) == (status, code), answer

        run(main)
        assert api.state.store.step_evaluation(STEP) is None


def test_forged_foreign_and_malformed_evaluations_are_refused(tmp_path: Path) -> None:
    digest = held_out(tmp_path)
    stranger = Identity.generate()
    with in_process_api(tmp_path) as api:

        async def main() -> None:
            mine = evaluation(api, digest)
            forged = sign(stranger, mine)  # the member's evaluation, someone else's signature
            assert (await post(api, forged))[0] == 401
            status, answer = await post(
                api, sign(stranger, evaluation(api, digest, peer_id=stranger.peer_id))
            )
            assert (status, answer["error"]) == (403, "unknown_peer")  # signed, but not a member's peer
            assert (await post(api, b"{not json"))[0] == 400
            assert (await post(api, {"evaluation": "AAAA", "signature": "AAAA"}))[0] == 422
            data = msgspec.msgpack.encode(mine)
            nan = data.replace(msgspec.msgpack.encode(3.5), msgspec.msgpack.encode(math.nan))
            body = msgspec.to_builtins(SignedEvaluation(nan, api.member.sign(evaluation_payload(nan))))
            status, answer = await post(api, body)
            assert (status, answer["error"]) == (422, "invalid")

        run(main)


def test_evaluations_are_rate_limited_per_peer(tmp_path: Path) -> None:
    digest = held_out(tmp_path)
    with in_process_api(tmp_path, evaluations_by_peer=RateLimiter(rate=0.001, burst=2)) as api:
        api.state.store.record_step(10, finished_at=time.time(), loss=4.0, samples=64, peers=1)

        async def main() -> None:
            codes = [
                (await post(api, sign(api.member, evaluation(api, digest, step=s))))[0] for s in (1, 2, 3)
            ]
            assert codes == [200, 200, 429]

        run(main)


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=300), signature=st.binary(min_size=64, max_size=64))
def test_arbitrary_evaluation_bytes_never_get_a_5xx(data: bytes, signature: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory, in_process_api(Path(directory)) as api:

        async def main() -> None:
            body = msgspec.to_builtins(SignedEvaluation(data, signature))
            status, _ = await post(api, body)
            assert 400 <= status < 500

        run(main)


def test_the_held_out_shard_is_served_apart_from_the_training_shards(tmp_path: Path) -> None:
    held_out(tmp_path)
    with in_process_api(tmp_path) as api:

        async def main() -> None:
            training = await api.request("GET", "shards", headers=api.credential("GET", "shards"))
            heldout = await api.request("GET", "heldout", headers=api.credential("GET", "heldout"))
            names = [s.name for s in msgspec.json.decode(training.content, type=ShardList).shards]
            listed = msgspec.json.decode(heldout.content, type=ShardList).shards
            assert HELDOUT_SHARD not in names and names
            assert [s.name for s in listed] == [HELDOUT_SHARD]
            path = f"heldout/{HELDOUT_SHARD}"
            shard = await api.request("GET", path, headers=api.credential("GET", path))
            assert shard.status_code == 200 and len(shard.content) == listed[0].nbytes
            assert (await api.request("GET", "heldout")).status_code == 401  # members only
            missing = await api.request(
                "GET", "heldout/x.jsonl", headers=api.credential("GET", "heldout/x.jsonl")
            )
            assert missing.status_code == 404

        run(main)
