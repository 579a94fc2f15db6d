"""Collaborative training (DESIGN §1; seed 000 §3.1).

Modules:
    trainer    LocalTrainer: the model, its optimizer, accumulated gradients, the state blob (torch; runs
               in worker threads)
    optimizer  CollaborativeOptimizer: progress in the DHT, averaging at the target batch, one optimizer
               step together, catching up by state download

The pure summary of the peers' progress records is :mod:`shared.progress` (backbones use it too).
"""

from __future__ import annotations

from .optimizer import CollabConfig as CollabConfig
from .optimizer import CollaborativeOptimizer as CollaborativeOptimizer
from .optimizer import StepRecord as StepRecord
from .trainer import Accumulated as Accumulated
from .trainer import LocalTrainer as LocalTrainer

__all__ = ["Accumulated", "CollabConfig", "CollaborativeOptimizer", "LocalTrainer", "StepRecord"]
