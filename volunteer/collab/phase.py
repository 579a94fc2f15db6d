"""What this peer is doing, as one explicit phase, and the facts the three parts of the collaborative
optimizer share (:mod:`.progress_board` publishes them, :mod:`.step` and :mod:`.sync` change them).

::

    FRESH ──accumulate (run at step 0) / state loaded──▶ TRAINING ◀──▶ AVERAGING
      │                                                    │  ▲
      └──────────────▶ SYNCING ◀───────────────────────────┘  │ state loaded
                         └────────────────────────────────────┘
    any phase ──leave──▶ LEFT

* ``FRESH``: our parameters are the initial ones and nobody has vouched for them yet (a newcomer, a
  restarted volunteer). A fresh peer never takes part in a round: it either finds the run at step 0 (the
  initial parameters *are* the run's) and starts training, or downloads the state first (issue 10, item 4:
  a rejoining peer's first step carries the collaboration's fingerprint).
* ``TRAINING``: accumulating micro-batches toward the next step.
* ``AVERAGING``: in a round toward ``round_step + 1`` with ``round_samples`` of ours (with delayed parameter
  updates, micro-batches go on meanwhile: they count toward the step after).
* ``SYNCING``: downloading the collaboration's state; back to ``TRAINING`` once loaded, or to where we came
  from if no state could be had.
* ``LEFT``: we told the others we left; nothing is published any more.

``anchored`` is not a phase: it says whether our state is the run's (we trained in it or downloaded it),
which stays true while we average or re-sync.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Phase", "PhaseError", "PeerState"]


class Phase(enum.Enum):
    FRESH = "fresh"
    TRAINING = "training"
    AVERAGING = "averaging"
    SYNCING = "syncing"
    LEFT = "left"


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.FRESH: frozenset({Phase.TRAINING, Phase.SYNCING, Phase.LEFT}),
    Phase.TRAINING: frozenset({Phase.AVERAGING, Phase.SYNCING, Phase.LEFT}),
    Phase.AVERAGING: frozenset({Phase.TRAINING, Phase.LEFT}),
    Phase.SYNCING: frozenset({Phase.TRAINING, Phase.FRESH, Phase.LEFT}),
    Phase.LEFT: frozenset(),
}


class PhaseError(RuntimeError):
    """A transition the diagram does not allow: a bug in the caller, never a peer's doing."""


@dataclass
class PeerState:
    phase: Phase = Phase.FRESH
    anchored: bool = False  # our state is the run's: we trained in it or downloaded it
    fingerprint: bytes = b""  # of our parameters (published once anchored)
    loss: float | None = None  # smoothed loss of our recent micro-batches
    round_step: int = -1  # while AVERAGING: the step whose round we are in
    round_samples: int = 0  # ... and our weight in it
    #: (step, its global batch) of the last step we took: published while our step is that one
    batch: tuple[int, int] = (0, 0)
    #: the last step at which our state was known to be the collaboration's (downloaded it, or a view
    #: showed another user at our step with our fingerprint); steps after it are ours alone until then
    agreed_step: int = 0
    agreed_before_load: int = 0  # ``agreed_step`` just before the last state load replaced it
    #: (step, the other members' peer ids) of the last complete round we stepped with: each of them
    #: applied the same average, so holds our state of that step (a leaver hands it over to one of them)
    stepped_with: tuple[int, frozenset[str]] = (-1, frozenset())

    def enter(self, phase: Phase) -> Phase:
        """Move to ``phase``; returns the phase we left. Entering the current phase is a no-op."""
        previous = self.phase
        if phase is not previous and phase not in _ALLOWED[previous]:
            raise PhaseError(f"{previous.value} -> {phase.value} is not a transition of the optimizer")
        self.phase = phase
        if phase is not Phase.AVERAGING:
            self.round_step, self.round_samples = -1, 0
        return previous

    @property
    def averaging(self) -> bool:
        return self.phase is Phase.AVERAGING

    @property
    def syncing(self) -> bool:
        return self.phase is Phase.SYNCING

    @property
    def left(self) -> bool:
        return self.phase is Phase.LEFT
