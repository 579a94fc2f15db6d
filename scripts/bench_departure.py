"""Departure benchmark: how long a SIGKILLed member stalls the others (issue 10, item 3).

``--peers`` processes on loopback form one DHT and average a float32 vector step after step the way the
collaborative optimizer does: per step, matchmaking (:class:`~shared.averaging.matchmaking.Matchmaker`,
group key ``a<attempt>``) then the all-reduce; an incomplete round is retried at once under the next
attempt's key. At step ``--kill-step`` the last peer SIGKILLs itself at a protocol moment (``--at``):

* ``joined`` -- right after storing its matchmaking ticket (it is in the group, dies before the plan);
* ``pushed`` -- right after its first part push of the round completes (mid-averaging);
* ``fault:<point>`` -- at the named fault point (:mod:`shared.faults`, armed through ``DEDLOC_FAULTS``
  to ``--action`` on the hit of the kill step, counting one hit per earlier step): ``kill`` (SIGKILL)
  or ``stop`` (SIGSTOP: the victim hangs with its connections open; it is SIGKILLed at the end).

``joined`` and ``pushed`` find their moment by wrapping methods of this code base (``DHTNode.store``,
``Averager._push_slice``), not by the named fault points, so that the same script measures code that
predates them. The kill time is the victim's own clock just before it dies, or (``fault:``) when its
output ends.

The **stall** of a trial is the time from the kill until every survivor has completed that step's
averaging (a complete round, after however many attempts). ``normal_round_s`` is the survivors' median
time per step before the kill (matchmaking window included), the floor any stall is measured against.
Prints one JSON object: per ``--at`` mode, the median and worst stall over ``--trials`` trials, and the
trials' details.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUN = "bench-departure"


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import trio

    from protocols.averaging import JoinTicket
    from shared.auth.keys import Identity
    from shared.averaging.allreduce import Averager
    from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig
    from shared.dht.node import DHTNode
    from shared.node import open_node

    victim = args.victim
    step_now = [-1]
    if args.verbose:
        import logging

        logging.basicConfig(
            level=logging.INFO, format=f"%(created).3f {os.getpid()} {'V' if victim else 'S'} %(message)s"
        )

    def note(message: str) -> None:
        if args.verbose:
            print(f"{time.time():.3f} {os.getpid()} {message}", file=sys.stderr)

    def die() -> None:
        print(json.dumps({"killed": time.time(), "step": step_now[0]}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if victim and args.at == "joined":
        store = DHTNode.store

        async def store_then_die(self: DHTNode, key: str | bytes, *a: object, **kw: object) -> int:
            stored = await store(self, key, *a, **kw)  # type: ignore[arg-type]
            if step_now[0] == args.kill_step and isinstance(key, str) and key.endswith(".a0"):
                die()
            return stored

        DHTNode.store = store_then_die  # type: ignore[method-assign]
    if victim and args.at == "pushed":
        push = Averager._push_slice

        async def push_then_die(self: Averager, *a: object, **kw: object) -> None:
            await push(self, *a, **kw)  # type: ignore[arg-type]
            if step_now[0] == args.kill_step:
                die()

        Averager._push_slice = push_then_die  # type: ignore[method-assign]

    async def main() -> None:
        initial = [args.bootstrap] if args.bootstrap else []
        async with open_node(
            Identity.generate(), RUN, "volunteer", listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial
        ) as node:
            averager = Averager(node.host)
            matchmaker = Matchmaker(node.dht, prefix="bench", config=MatchmakingConfig(window=args.window))
            print(json.dumps({"addr": node.host.listen_addrs[0]}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)  # everyone is up
            vector = np.empty(args.numel, dtype=np.float32)
            for step in range(args.kill_step + 1):
                step_now[0] = step
                started = time.time()
                for attempt in range(args.max_attempts):
                    vector.fill(1.0)
                    ticket = JoinTicket(
                        addr=node.host.listen_addrs[0],
                        weight=1.0,
                        norm=float(np.linalg.norm(vector.astype(np.float64))),
                        samples_per_second=10.0,
                        upload_bps=1e9,
                        download_bps=1e9,
                    )
                    plan = await matchmaker.assemble(step, ticket, args.numel, group_key=f"a{attempt}")
                    note(f"step {step} a{attempt}: plan of {plan and len(plan.members)}")
                    if plan is None:
                        continue
                    me = next(i for i, m in enumerate(plan.members) if m.peer_id == node.host.peer_id)
                    result = await averager.all_reduce(plan, vector, me)
                    matchmaker.record_round(plan.deadline / 2, result.seconds)
                    departed = getattr(result, "departed", "")  # not in code before issue 10
                    note(f"step {step} a{attempt}: complete {result.outcome.complete} {departed}")
                    if result.outcome.complete:
                        report = {"step": step, "attempts": attempt + 1, "members": len(plan.members)}
                        print(json.dumps({**report, "start": started, "end": time.time()}), flush=True)
                        break
                else:
                    print(json.dumps({"step": step, "failed": True, "end": time.time()}), flush=True)
                    break
            # keep serving our slice to slower members until everyone is done (as a volunteer would)
            print(json.dumps({"done": True}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)

    trio.run(main)


class _StepEnd(TypedDict):
    step: int
    end: float


class StepReport(_StepEnd, total=False):
    """A survivor's line for one step (``worker``): completed (``attempts``, ``members``, ``start``) or
    ``failed``."""

    attempts: int
    members: int
    start: float
    failed: bool


def trial(args: argparse.Namespace, at: str) -> dict[str, object]:
    def spawn(extra: list[str]) -> subprocess.Popen[str]:
        env = dict(os.environ)
        if at.startswith("fault:") and "--victim" in extra:
            env["DEDLOC_FAULTS"] = f"{at.removeprefix('fault:')}={args.action}@{args.kill_step + 1}"
        command = [sys.executable, __file__, "--worker", "--at", at, *extra]
        for name in ("numel", "window", "kill_step", "max_attempts"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        command += ["--verbose"] if args.verbose else []
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    procs = [spawn([])]
    try:
        boot = json.loads(procs[0].stdout.readline())["addr"]  # type: ignore[union-attr]
        for rank in range(1, args.peers):
            procs.append(spawn(["--bootstrap", boot, *(["--victim"] if rank == args.peers - 1 else [])]))
            json.loads(procs[-1].stdout.readline())  # type: ignore[union-attr]
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        killed = None
        if at.startswith("fault:") and args.action == "stop":
            os.waitpid(procs[-1].pid, os.WUNTRACED)  # returns once it froze, connections open
            killed = time.time()
        for line in procs[-1].stdout if killed is None else ():  # type: ignore[union-attr]
            if "killed" in (event := json.loads(line)):
                killed = event["killed"]
        if killed is None and at.startswith("fault:") and procs[-1].wait(timeout=60) == -signal.SIGKILL:
            killed = time.time()  # its output ended: it is dead
        survivors: list[list[StepReport]] = []
        for p in procs[:-1]:
            events: list[StepReport] = []
            while "done" not in (event := json.loads(p.stdout.readline())):  # type: ignore[union-attr]
                events.append(event)
            survivors.append(events)
        for p in procs[:-1]:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    last = [s[-1] for s in survivors]
    before = [e["end"] - e["start"] for s in survivors for e in s[:-1]]
    return {
        "stall_s": None if killed is None else max(e["end"] for e in last) - killed,
        "survivors_completed": all(not e.get("failed") and e["step"] == args.kill_step for e in last),
        "attempts": [e.get("attempts") for e in last],
        "survivor_steps": [[e["step"] for e in s] for s in survivors],
        "normal_round_s": statistics.median(before) if before else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--window", type=float, default=1.0, help="matchmaking window (the optimizer's)")
    parser.add_argument("--kill-step", type=int, default=2)
    parser.add_argument("--max-attempts", type=int, default=6)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--at", default="joined,pushed", help="comma-separated kill moments")
    parser.add_argument("--action", default="kill", choices=["kill", "stop"], help="for fault: moments")
    parser.add_argument("--verbose", action="store_true", help="children log to stderr at INFO")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--victim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out: dict[str, object] = {"peers": args.peers, "numel": args.numel, "window": args.window}
    for at in args.at.split(","):
        trials = [trial(args, at) for _ in range(args.trials)]
        stalls = [t["stall_s"] for t in trials if isinstance(t["stall_s"], float)]
        out[at] = {
            "stall_s_median": statistics.median(stalls) if stalls else None,
            "stall_s_worst": max(stalls) if stalls else None,
            "trials": trials,
        }
    out["loadavg"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
