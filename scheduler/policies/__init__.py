"""Adaptation policies: ResiHP, its Figure 11 ablations, and the baselines of §8.1.

A policy maps (current state, device speeds ``p``) to a new state or raises
:class:`Abort` when it cannot continue.  A state is a list of independent
pipeline groups (``Layout``), usually one; Oobleck's heterogeneous pipelines
are several.  Each policy also states how it reacts in time: detection delays
and reconfiguration cost, used by the analytical timeline (``scheduler.simulate``).

=====================  ========================================================
name                   behaviour
=====================  ========================================================
none                   no adaptation (the "degraded" baseline of Figure 9)
resihp                 TP selective exclusion -> PP repartition -> DP migration
resihp-tp              ablation: selective exclusion only (+ ReCycle-style eviction)
resihp-tp-pp           ablation: + layer repartition
recycle                whole TP groups dropped; failed stage's micro-batches
                       rerouted round-robin to DP peers, run within the peer's
                       fault-free 1F1B memory; no fail-slow handling
greyhound              fail-slow: micro-batch counts per replica by speed;
                       cannot tolerate fail-stop
adaptra                fail-slow: pipeline schedule adaptation (ZB-H1 slack);
                       no layer moves; cannot tolerate fail-stop
oobleck                whole TP groups dropped; pipelines re-instantiated from
                       templates on the surviving TP groups (fewer stages)
recycle+greyhound      strengthened ReCycle (§8.1)
oobleck+greyhound      strengthened Oobleck (§8.1)
recycle-ideal          extra: rerouted chunks list-scheduled into any idle slot
                       (no memory bound); never in a headline table
=====================  ========================================================
"""

from __future__ import annotations

from scheduler.policies.base import POLICIES, Abort, Policy, get_policy

__all__ = ["POLICIES", "Abort", "Policy", "get_policy"]
