"""What "open" means for a failure: the one definition the console, ``resihp status`` and
the dashboard's overview and incidents pages all use.

A failure report is **open** while a device it names (a rank, or either end of a link) is
still failed, that is its device-health state is anything but ``healthy`` (slow, dead,
standby, ...), and it is the newest report naming that device: a fail-slow rank that later
died is one open failure, the fail-stop. A report none of whose devices is still failed is
closed. Recovery reports are never open. Throughput coming back (a plan that worked around
a dead GPU) does not close a failure: the device still has to come back or be replaced;
the incident view says both ("open, throughput recovered").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from resihp.schemas import FailureReport


def is_failed_state(state: Any) -> bool:
    """A device-health state that keeps a failure naming the device open."""
    return state not in (None, "healthy")


def failed_ranks(device_health: Mapping[Any, Any]) -> set[int]:
    """Ranks whose device-health entry (rank -> {"state": ...}) says failed; malformed
    entries are skipped."""
    out = set()
    for rank, h in device_health.items():
        try:
            r = int(rank)
        except (TypeError, ValueError):
            continue
        if isinstance(h, dict) and is_failed_state(h.get("state")):
            out.add(r)
    return out


def open_failures(
    reports_newest_first: Iterable[FailureReport],
    failed: set[int],
    world_size: int | None = None,
) -> list[FailureReport]:
    """The open reports among ``reports_newest_first``, newest first: each failed device
    is charged to the newest report naming it.  A report naming a rank beyond the layout
    (``world_size``) is one the scheduler refused (a forged one of 100,000 ranks): it is
    never open."""
    if not failed:
        return []
    out, claimed = [], set()
    for f in reports_newest_first:
        if f.kind == "recovery":
            continue
        named = set(f.ranks) | {r for link in f.links for r in link}
        if world_size is not None and named and max(named) >= world_size:
            continue
        mine = (named & failed) - claimed
        if mine:
            out.append(f)
            claimed |= mine
        if claimed >= failed:
            break
    return out


def open_report_ids(
    reports_newest_first: Iterable[FailureReport],
    device_health: Mapping[Any, Any],
    world_size: int | None = None,
) -> set[str]:
    """The ids of the open reports, given the job's device health (rank -> {"state": ...})."""
    failed = failed_ranks(device_health)
    return {f.report_id for f in open_failures(reports_newest_first, failed, world_size)}
