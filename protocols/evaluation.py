"""Held-out evaluation during a run: what an evaluator publishes and the backbone records (issue 12 item 7).

**The held-out set.** Every evaluator of a run computes the loss over the *same* examples in the *same*
order, so two honest evaluators of one step's parameters report the same number (to float tolerance)
and the backbone can cross-check them:

* ``dataset.source = "backbone"``: the held-out shards are the ``.jsonl`` files of the ``heldout/``
  directory under the backbone's shard directory, served at ``GET heldout`` and ``GET heldout/<name>``,
  never in the training listing (``GET shards`` lists only the files directly in the shard directory,
  so an older volunteer cannot train on them either). With ``dataset.generate`` set, the backbone writes
  ``heldout/heldout-00000.jsonl`` of ``dataset.eval_examples`` examples of the synthetic corpus (a seed
  of its own); an organizer with shards of its own puts its held-out files there. ``dataset.eval_files``
  (name patterns) restricts which of them count.
* ``files`` / ``hub``: ``dataset.eval_files`` names local files (paths or globs, JSON lines or text) on
  each evaluator's machine; the training stream never reads them unless ``files`` names them too.

The held-out examples are the first ``dataset.eval_examples`` examples of those files read in sorted name
order, line after line (:mod:`shared.data.heldout`). ``eval_set`` is the SHA-256 of their canonical JSON
(:func:`shared.data.heldout.heldout_digest`): evaluators name the examples they used, and a backbone that
serves the held-out shards refuses an evaluation of other examples.

**The record.** After the optimizer step that takes the run to ``step`` (every ``dataset.eval_every``
steps, or ``volunteer join --evaluate-every N``), an evaluator copies those parameters (fingerprint
``params``, as in the ``step N done`` log lines), computes the task's mean loss over the held-out samples
in evaluation mode without gradients, encodes an :class:`Evaluation` with msgpack and signs
:func:`evaluation_payload` of those bytes with its identity key: a :class:`SignedEvaluation`, sent as
``POST evaluations``. Bounds (checked before anything is stored): every field's range below; the run id
is the backbone's; ``timestamp`` within ``protocols.auth.MAX_CLOCK_SKEW`` of the backbone's clock (an old
record cannot be replayed); ``examples`` equals the manifest's ``dataset.eval_examples``; ``eval_set`` is
the backbone's own held-out digest where it has one; ``step`` is at most
the newest step the backbone's step log holds plus :data:`MAX_STEPS_AHEAD`; ``(peer_id, step)`` is
recorded once (a second record of it answers 409). The answer is an :class:`EvaluationReceipt` with the
step's cross-checked loss so far.

**Cross-check** (DESIGN D10: a claim is bounded by what others saw; :mod:`backbone.ledger.evaluations`):
the recorded loss of a step is the median over *users* of each user's median claim, among the claims of
the parameters and held-out set most users evaluated; claims of other parameters, or further than the
tolerance from that median, are outliers; a step only one user evaluated is marked single-sourced.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from .errors import ProtocolError
from .types import Bytes64, PeerIdStr, RunIdStr

__all__ = [
    "MAX_EVAL_EXAMPLES",
    "MAX_EVALUATION_BYTES",
    "MAX_LOSS",
    "MAX_STEPS_AHEAD",
    "Evaluation",
    "EvaluationReceipt",
    "SignedEvaluation",
    "decode_evaluation",
    "evaluation_payload",
]

#: An encoded :class:`Evaluation` is about 200 bytes.
MAX_EVALUATION_BYTES = 1024
#: The most held-out examples a run may name (each evaluator holds them in memory).
MAX_EVAL_EXAMPLES = 100_000
#: Losses beyond this are garbage, not losses of a model (a float32 cross-entropy is below ~100).
MAX_LOSS = 1e6
#: How far an evaluated step may be past the newest step the backbone recorded: its step tracker polls
#: the DHT about once a second, so an honest evaluator is at most a few steps ahead of it.
MAX_STEPS_AHEAD = 16
_MAX_STEP = 2**40
_MAX_TIME = 1e12
_DOMAIN = b"dedloc-evaluation-v1"


class Evaluation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``peer_id``'s held-out loss of the parameters at ``step`` (see the module docstring)."""

    run_id: RunIdStr
    peer_id: PeerIdStr
    step: Annotated[int, msgspec.Meta(ge=1, le=_MAX_STEP)]
    #: the fingerprint of the evaluated parameters (LocalTrainer.fingerprint, 8 bytes today)
    params: Annotated[bytes, msgspec.Meta(min_length=1, max_length=16)]
    #: the task's mean loss over the held-out samples
    loss: Annotated[float, msgspec.Meta(ge=-MAX_LOSS, le=MAX_LOSS)]
    #: how many held-out examples it read (the manifest's ``dataset.eval_examples``)
    examples: Annotated[int, msgspec.Meta(ge=1, le=MAX_EVAL_EXAMPLES)]
    #: SHA-256 (hex) of those examples' canonical JSON (shared.data.heldout.heldout_digest)
    eval_set: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    #: unix time of the evaluation (the backbone accepts it within MAX_CLOCK_SKEW of its clock)
    timestamp: Annotated[float, msgspec.Meta(ge=0, le=_MAX_TIME)]

    def __post_init__(self) -> None:
        # msgspec checks the Meta bounds only when decoding; NaN compares false against every bound.
        if not (math.isfinite(self.loss) and -MAX_LOSS <= self.loss <= MAX_LOSS):
            raise ValueError(f"loss {self.loss!r} is not a finite number within ±{MAX_LOSS:g}")
        if not (math.isfinite(self.timestamp) and 0 <= self.timestamp <= _MAX_TIME):
            raise ValueError(f"timestamp {self.timestamp!r} is not a unix time")
        if not (1 <= self.step <= _MAX_STEP and 1 <= self.examples <= MAX_EVAL_EXAMPLES):
            raise ValueError(f"step {self.step} or examples {self.examples} out of range")


class SignedEvaluation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A msgpack-encoded :class:`Evaluation` and its writer's signature over :func:`evaluation_payload`."""

    evaluation: Annotated[bytes, msgspec.Meta(max_length=MAX_EVALUATION_BYTES)]
    signature: Bytes64


def evaluation_payload(evaluation_bytes: bytes) -> bytes:
    """The bytes an evaluator signs: a domain tag, then the evaluation's msgpack bytes."""
    return _DOMAIN + evaluation_bytes


_DECODER = msgspec.msgpack.Decoder(Evaluation)


def decode_evaluation(data: bytes | memoryview) -> Evaluation:
    """Decode the msgpack :class:`Evaluation` inside a :class:`SignedEvaluation`.

    Raises:
        ProtocolError: longer than :data:`MAX_EVALUATION_BYTES`, malformed, or a field out of range.
    """
    if len(data) > MAX_EVALUATION_BYTES:
        raise ProtocolError(f"an evaluation of {len(data)} bytes exceeds {MAX_EVALUATION_BYTES}")
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:  # __post_init__ checks too
        raise ProtocolError(f"invalid evaluation: {exc}") from exc


class EvaluationReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The backbone's answer to ``POST evaluations``: the step's cross-checked held-out loss so far."""

    step: int
    #: the step's recorded held-out loss (the median of the module docstring)
    loss: float
    #: how many users' evaluators agree on it (1: single-sourced, not cross-checked)
    users: int
    #: False: this claim is an outlier (other parameters, or too far from the others' loss)
    agrees: bool
