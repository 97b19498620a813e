"""The garbage collector's pauses, watched and kept out of serving: a full collection of a
large heap stops every thread of the process, the engine loop's included."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class GcWatch:
    """The garbage collector's pauses in this process, per generation (count, total and
    longest ms; since start-up ended, once `start_serving` is called), through
    `gc.callbacks`: a full collection of a large heap stops every thread of the process,
    the engine loop's included, and shows up as a stall in whatever step was running. One
    per process (`gc_watch()`); while serving, a pause over `warn_ms` is logged."""

    def __init__(self, warn_ms: float = 100.0):
        self.warn_ms = warn_ms
        self._t0 = 0.0
        self.serving = False
        self.reset()

    def reset(self) -> None:
        self.gens = [{"count": 0, "total_ms": 0.0, "max_ms": 0.0} for _ in range(3)]

    def start_serving(self) -> None:
        """From here on the counts are serving's (start-up's are dropped) and long pauses
        are logged."""
        self.reset()
        self.serving = True

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1000
        g = self.gens[min(int(info.get("generation", 0)), 2)]
        g["count"] += 1
        g["total_ms"] += ms
        g["max_ms"] = max(g["max_ms"], ms)
        if ms > self.warn_ms and self.serving:
            log.warning("gc: generation %s collection took %.0f ms (%s objects collected)",
                        info.get("generation"), ms, info.get("collected"))

    def stats(self) -> dict[str, Any]:
        import gc

        return {"frozen": gc.get_freeze_count(),
                **{f"gen{i}": {k: round(v, 1) for k, v in g.items()} for i, g in
                   enumerate(self.gens)}}


def in_serve_replica() -> bool:
    try:
        from ray import serve
        from ray.serve.exceptions import RayServeException
    except ImportError:
        return False
    try:
        serve.get_replica_context()
    except RayServeException:  # outside a replica: in-process servers, tests
        return False
    return True


def freeze_startup_objects(*, force: bool = False) -> bool:
    """In a Serve replica (or with `force`): move everything alive after start-up (modules,
    weights' Python objects, graphs, tables) out of the collector's reach: a full collection
    then scans only what serving allocates, instead of the hundreds of thousands of objects
    a stage holds after start-up, which would stop the engine loop for as long (see
    docs/performance.md). Collecting first leaves the start-up's own garbage out of the
    frozen set. Not in a shared process (tests build
    servers in-process): there it would also pin whatever the process made before."""
    import gc

    if not (force or in_serve_replica()):
        return False
    gc.collect()
    gc.freeze()
    gc_watch().start_serving()
    return True


@functools.cache
def gc_watch() -> GcWatch:
    import gc

    watch = GcWatch()
    gc.callbacks.append(watch)
    return watch
