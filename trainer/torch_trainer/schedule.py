"""Per-stage action lists for GPipe, 1F1B and ZB-H1.

An action is (kind, microbatch) with kind "F", "B" or "W".  In GPipe and
1F1B, "B" is the fused backward (input and weight gradients); in ZB-H1, "B"
computes input gradients only and "W" the deferred weight gradients.

ZB-H1 (Qi et al., 2024) keeps 1F1B's warm-up (so the same activation memory)
and defers the W of stage s by (pp - 1 - s) backward steps: the last stage
runs F B W back to back, earlier stages fill their cool-down bubbles, which
1F1B leaves idle, with the postponed W chunks.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "zbh1")


def actions(schedule: str, stage: int, pp: int, num_mb: int) -> list[tuple[str, int]]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside pipeline of {pp}")
    m = num_mb
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(pp - 1 - stage, m)
    out: list[tuple[str, int]] = [("F", j) for j in range(warm)]
    f_next, b_next = warm, 0
    while b_next < m:
        if f_next < m:
            out.append(("F", f_next))
            f_next += 1
        out.append(("B", b_next))
        b_next += 1
    if schedule == "1f1b":
        return out
    # ZB-H1: insert W(j) after the B that comes (pp-1-stage) backward steps later.
    lag = pp - 1 - stage
    zb: list[tuple[str, int]] = []
    w_next = 0
    b_seen = 0
    for kind, j in out:
        zb.append((kind, j))
        if kind == "B":
            b_seen += 1
            if b_seen - w_next > lag:
                zb.append(("W", w_next))
                w_next += 1
    zb.extend(("W", j) for j in range(w_next, m))
    return zb
