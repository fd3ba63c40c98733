"""Cluster simulator back end of the trainer: a TP x PP x DP job of up to 16,384 simulated ranks.

``python -m trainer sim ...`` runs :class:`trainer.sim.service.SimTrainer`
against Redis; :func:`trainer.sim.core.simulate_run` generates the same
telemetry offline.  See docs/scenario.md for failure scenarios.
"""

from __future__ import annotations

from .config import SimConfig
from .core import ClusterSim, SimStep, TrueState, simulate_run


def main(argv: list[str] | None = None) -> int:
    from .cli import main as _main

    return _main(argv)


__all__ = ["ClusterSim", "SimConfig", "SimStep", "TrueState", "main", "simulate_run"]
