"""The negative control of the row checks: loads that put every row one token late (row r receives row r-1's bytes,
a chunk's first row its last), made by rolling the slots the mover cut and cutting them again."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from lmcache_npu import _host
from lmcache_npu.ops import CutRuns, Direction

CutRunsFn = Callable[[Any, Any], Any]


def loads_one_token_late(right: CutRunsFn) -> CutRunsFn:
    """A `KVMover._cut_runs` that calls `right` and, for loads, rolls each moved group's slots by one row."""

    def one_token_late(mover: Any, job: Any) -> Any:
        moves, objects, cuts = right(mover, job)
        if job.direction == Direction.STORE:
            return moves, objects, cuts
        late = []
        for group, cut in zip(mover._run_groups, cuts):
            if cut is None or not group[8]:  # no slots, or not moved: nothing to roll
                late.append(cut)
                continue
            slots = np.ascontiguousarray(np.roll(cut.slots, 1, axis=1))
            runs, problem, at, again = _host.slot_runs(slots, group[9], group[10], False, True)
            late.append(CutRuns(slots, runs, problem, at, again))
        return moves, objects, late

    return one_token_late
