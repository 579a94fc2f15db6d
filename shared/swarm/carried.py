"""Trainers' receipts of a swarm run: what a stage server signs for a trainer, and what the trainer checks
(issue 17 item 6; the wire is :mod:`protocols.receipts`, "Trainers' receipts", and :mod:`protocols.swarm`,
"Receipts"; how the ledger credits them: :mod:`backbone.ledger.accounting`, "Swarm trainers").

**Server side.** :class:`CarriedTally` keeps, per ``(trainer, stage step)``, the samples of the backwards
the server completed for that trainer toward that step and the payload bytes of every request of that
trainer it answered meanwhile (forwards count bytes, no samples: :meth:`CarriedTally.count` with 0
samples; they are signed in the next backward's receipt of the key, and the ledger credits them as the
trainer's bytes sent, :mod:`backbone.ledger.accounting`, "Swarm bytes"), so each receipt it signs is
*cumulative*: the trainer keeps only the latest per ``(server, stage, step)``, and a receipt that was lost
(its answer never arrived) is covered by the next one of that key. The tally is bounded: it forgets steps
more than :data:`KEEP_STEPS` behind the newest it saw (a trainer's backward counts toward the server's
current step, so older keys never grow again) and holds at most :data:`MAX_TALLIED` keys, dropping the
oldest. A key forgotten and seen again starts from zero: its next receipt is smaller than one the trainer
may hold, which the trainer's book and the ledger both ignore (they keep the larger), so nothing is
credited twice and at worst the samples after the reset go uncounted.

**Trainer side.** :func:`check_carried` accepts a receipt only if its bytes decode, it is ``carried``, of
this run, signed by the server the trainer called (the key inside that peer id), about the trainer
itself, of the stage it asked, and states at least the samples of the backward it answers (cumulative:
never less than this micro-batch). Anything else is refused with the reason; the trainer drops it and
counts it (:attr:`volunteer.swarm.client.SwarmStatistics.bad_receipts`): a server that signs garbage
harms nobody but its own credit of the trainer, so it is not banned for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from protocols.errors import ProtocolError
from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, receipt_payload, sign_receipt
from shared.auth.keys import verify_by_peer_id

__all__ = ["KEEP_STEPS", "MAX_TALLIED", "CarriedTally", "check_carried"]

#: Stage steps behind the newest seen whose tallies a server keeps (a backward counts toward the current).
KEEP_STEPS = 2
#: The most ``(trainer, step)`` keys a server tallies at once (far above the trainers of one stage step).
MAX_TALLIED = 4096


class CarriedTally:
    """A stage server's cumulative per-trainer counts and the receipts it signs (module docstring)."""

    def __init__(
        self,
        run_id: str,
        server: str,
        stage: int,
        sign: Callable[[bytes], bytes],
        *,
        max_keys: int = MAX_TALLIED,
    ) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.run_id = run_id
        self.server = server
        self.stage = stage
        self.sign = sign
        self.max_keys = max_keys
        self._counts: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()
        self._newest = -1

    def __len__(self) -> int:
        return len(self._counts)

    def count(self, trainer: str, step: int, samples: int, nbytes: int) -> tuple[int, int]:
        """Add one answered request of ``trainer`` toward stage step ``step`` (a forward: 0 samples);
        returns the cumulative ``(samples, bytes)`` of that key."""
        if samples < 0 or nbytes < 0 or step < 0:
            raise ValueError(f"negative count: {step=}, {samples=}, {nbytes=}")
        if step > self._newest:
            self._newest = step
            for key in [k for k in self._counts if k[1] < step - KEEP_STEPS]:
                del self._counts[key]
        key = (trainer, step)
        done, received = self._counts.pop(key, (0, 0))
        total = (done + samples, received + nbytes)
        self._counts[key] = total
        while len(self._counts) > self.max_keys:
            self._counts.popitem(last=False)
        return total

    def receipt(self, trainer: str, step: int, samples: int, nbytes: int) -> SignedReceipt:
        """Count one completed backward (:meth:`count`) and sign the key's cumulative receipt."""
        done, received = self.count(trainer, step, samples, nbytes)
        body = PartReceipt(
            run_id=self.run_id,
            aggregator=self.server,
            sender=trainer,
            step=step,
            group_id=b"",
            round=0,
            weight=float(done),
            nbytes=received,
            issued_at=time.time(),
            stage=self.stage,
            carried=True,
        )
        return sign_receipt(body, self.sign)


def check_carried(
    signed: SignedReceipt, *, run_id: str, server: str, trainer: str, stage: int, samples: int
) -> PartReceipt:
    """The receipt a server answered a backward of ``samples`` samples with, checked (module docstring).

    Raises:
        ProtocolError: undecodable, not a trainer's receipt, another run's, server's, trainer's or
            stage's, fewer samples than the backward, or a signature that does not verify.
    """
    receipt = decode_receipt(signed.receipt)
    if not receipt.carried:
        raise ProtocolError("not a trainer's receipt (carried is not set)")
    if receipt.run_id != run_id:
        raise ProtocolError(f"a receipt of run {receipt.run_id!r}")
    if receipt.aggregator != server:
        raise ProtocolError(f"signed as {receipt.aggregator}, not the server called")
    if receipt.sender != trainer:
        raise ProtocolError(f"a receipt for trainer {receipt.sender}")
    if receipt.stage != stage:
        raise ProtocolError(f"a receipt of stage {receipt.stage}, the request was to stage {stage}")
    if receipt.weight < samples:
        raise ProtocolError(f"{receipt.weight:g} samples, fewer than the backward's {samples}")
    if not verify_by_peer_id(server, signed.signature, receipt_payload(signed.receipt)):
        raise ProtocolError(f"the signature does not verify with the key of {server}")
    return receipt
