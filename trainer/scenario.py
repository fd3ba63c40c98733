"""Compatibility alias: the scenario format lives in the shared core (resihp.scenario),
so the simulator, the torch trainer and the scheduler's analytical timeline read one parser."""

from resihp.scenario import *  # noqa: F403
from resihp.scenario import (  # noqa: F401 - private helpers some callers use
    _line_map,
    _parse_event,
    main,
)
