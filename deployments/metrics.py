"""The app's Ray metrics (Ray dashboard / Prometheus; names get Ray's `ray_` prefix).

Per app (ingress):  omniray_requests_total{outcome}  ok | error | timeout | cancelled |
                        rejected (refused with a 4xx, over HTTP or the handle)
                    omniray_errors_total{reason}  every outcome but ok, by reason
                        (invalid_request, too_large, not_found, voice_error,
                        stage_error, stage_unavailable, stage_busy, timeout, cancelled...)
                    omniray_ttft_seconds, omniray_first_audio_seconds, omniray_rtf,
                    omniray_audio_seconds_total, omniray_window_active,
                    omniray_window_waiting, omniray_queue_wait_seconds (an admitted
                    speech turn's wait for a window slot; 0 when one was free)
                    omniray_stage_cache_hits_total{stage="ingress",cache="media"} and
                    omniray_stage_stat{stage="ingress",name="media_cache_*"} (misses,
                        bytes, entries, evictions of the processed-media cache)
Per stage:          omniray_stage_step_seconds{stage}, omniray_stage_batch_size{stage},
                    omniray_stage_queue_depth{stage},
                    omniray_stage_active_streams{stage} (turns holding state in the stage),
                    omniray_stage_free_slots{stage} (Talker stream slots / Thinker KV blocks),
                    omniray_stage_streams_held{stage} (the turns its memory holds, measured
                        once it is built: Thinker KV, Talker KV slots, Code2Wav slot pool),
                    omniray_stage_stream_bytes{stage} (the memory one such turn takes),
                    omniray_stage_kv_usage{stage}, omniray_stage_cache_hits_total{stage,cache},
                    omniray_stage_graph_steps_total{stage,path="graph"|"eager"},
                    omniray_stage_stat{stage,name} (every other numeric engine stat)
Ray tags every series with the reporting process's WorkerId: after a replica restarts, Ray
stops exporting the dead process's gauges, and its counters stay (frozen) under the old
WorkerId, so sums over workers never go backwards.

Engine stats are read from `engine.stats()` at most every STATS_PERIOD_S, on the engine's
worker thread; keys the engines may report: num_running / num_waiting, num_free_blocks /
num_total_blocks (KV usage), *_cache_hits, graph_replays / eager_steps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64]
QUEUE_BUCKETS = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
RTF_BUCKETS = [0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8]

_lock = threading.Lock()
_metrics: dict[str, Any] = {}


def _metric(kind: type, name: str, description: str, **kw: Any) -> Any:
    """One instance per process and name (Ray rejects re-registering with other tags)."""
    with _lock:
        if name not in _metrics:
            _metrics[name] = kind(name, description=description, **kw)
        return _metrics[name]


class StageMetrics:
    def __init__(self, stage: str):
        self.tags = {"stage": stage}
        tk = ("stage",)
        self.step = _metric(Histogram, "omniray_stage_step_seconds", "engine step time",
                            boundaries=STEP_BUCKETS, tag_keys=tk)
        self.batch = _metric(Histogram, "omniray_stage_batch_size", "outputs per engine step",
                             boundaries=BATCH_BUCKETS, tag_keys=tk)
        self.queue = _metric(Gauge, "omniray_stage_queue_depth",
                             "commands waiting for the engine thread", tag_keys=tk)
        self.active = _metric(Gauge, "omniray_stage_active_streams",
                              "turns holding state in the stage", tag_keys=tk)
        self.free_slots = _metric(Gauge, "omniray_stage_free_slots",
                                  "free Talker stream slots / Thinker KV blocks", tag_keys=tk)
        self.kv = _metric(Gauge, "omniray_stage_kv_usage", "fraction of KV blocks in use",
                          tag_keys=tk)
        self.cache = _metric(Counter, "omniray_stage_cache_hits_total", "cache hits",
                             tag_keys=("stage", "cache"))
        self.graphs = _metric(Counter, "omniray_stage_graph_steps_total",
                              "CUDA graph replays vs eager fallbacks", tag_keys=("stage", "path"))
        self.stat = _metric(Gauge, "omniray_stage_stat", "other numeric engine stats",
                            tag_keys=("stage", "name"))
        self.held = _metric(Gauge, "omniray_stage_streams_held",
                            "turns the stage's memory holds (measured at start)", tag_keys=tk)
        self.stream_bytes = _metric(Gauge, "omniray_stage_stream_bytes",
                                    "memory one turn takes in the stage", tag_keys=tk)
        self._last_stats = 0.0
        self._counters: dict[str, float] = {}
        self.engine_stats: Any = None  # callable returning the engine's stats dict

    def on_step(self, rec: Any) -> None:
        self.step.observe(rec.seconds, tags=self.tags)
        if rec.outputs:
            self.batch.observe(rec.outputs, tags=self.tags)
        self.queue.set(rec.queued_commands, tags=self.tags)
        now = time.monotonic()
        if self.engine_stats is not None and now - self._last_stats > STATS_PERIOD_S:
            self._last_stats = now
            try:
                self.record_stats(self.engine_stats())
            except Exception:
                log.debug("stats for metrics failed", exc_info=True)

    def holds(self, held: dict[str, Any]) -> None:
        """What the stage's memory holds (StageServer's `holds`), once, at start."""
        self.held.set(held["streams"], tags=self.tags)
        self.stream_bytes.set(held["stream_bytes"], tags=self.tags)

    def streams(self, n: int) -> None:
        self.active.set(n, tags=self.tags)

    def record_stats(self, stats: dict[str, Any]) -> None:
        stage = self.tags["stage"]
        if stats.get("num_total_blocks"):
            used = 1 - stats.get("num_free_blocks", 0) / stats["num_total_blocks"]
            self.kv.set(used, tags=self.tags)
            self.free_slots.set(stats.get("num_free_blocks", 0), tags=self.tags)
        if "free_slots" in stats:
            self.free_slots.set(stats["free_slots"], tags=self.tags)
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key.endswith("cache_hits"):
                self._bump(self.cache, key, value, {"stage": stage, "cache": key[:-11]})
            elif key in ("graph_replays", "eager_steps"):
                path = "graph" if key == "graph_replays" else "eager"
                self._bump(self.graphs, key, value, {"stage": stage, "path": path})
            else:
                self.stat.set(value, tags={"stage": stage, "name": key})

    def _bump(self, counter: Any, key: str, total: float, tags: dict[str, str]) -> None:
        """Engines report running totals; Ray counters take increments."""
        delta = total - self._counters.get(key, 0)
        self._counters[key] = total
        if delta > 0:
            counter.inc(delta, tags=tags)


class AppMetrics:
    def __init__(self) -> None:
        self.requests = _metric(Counter, "omniray_requests_total", "requests by outcome",
                                tag_keys=("outcome",))
        self.errors = _metric(Counter, "omniray_errors_total",
                              "requests that did not end ok, by reason", tag_keys=("reason",))
        self.ttft = _metric(Histogram, "omniray_ttft_seconds", "time to first text",
                            boundaries=LATENCY_BUCKETS)
        self.first_audio = _metric(Histogram, "omniray_first_audio_seconds",
                                   "time to first audio piece", boundaries=LATENCY_BUCKETS)
        self.rtf = _metric(Histogram, "omniray_rtf",
                           "last audio time / audio seconds (queueing included)",
                           boundaries=RTF_BUCKETS)
        self.audio_seconds = _metric(Counter, "omniray_audio_seconds_total", "audio produced")
        self.window_active = _metric(Gauge, "omniray_window_active", "turns in the GPU stages")
        self.window_waiting = _metric(Gauge, "omniray_window_waiting", "turns waiting FIFO")
        self.queue_wait = _metric(Histogram, "omniray_queue_wait_seconds",
                                  "an admitted speech turn's wait for a window slot",
                                  boundaries=QUEUE_BUCKETS)
        self.window(0, 0)  # a fresh process exports its own (empty) window at once
        self._realtime = _metric(Gauge, "omniray_realtime_sessions",
                                 "open realtime (WebSocket) sessions")
        self._ingress = StageMetrics("ingress")  # the stage families, for the media cache

    def media_cache(self, stats: dict[str, int]) -> None:
        """Running totals of the processed-media cache (called from one thread)."""
        self._ingress.record_stats({f"media_cache_{k}": v for k, v in stats.items()
                                    if k != "capacity_bytes"})

    def realtime_sessions(self, n: int) -> None:
        self._realtime.set(n)

    def outcome(self, outcome: str, reason: str | None = None) -> None:
        self.requests.inc(1, tags={"outcome": outcome})
        if outcome != "ok":
            self.errors.inc(1, tags={"reason": reason or outcome})

    def window(self, active: int, waiting: int) -> None:
        self.window_active.set(active)
        self.window_waiting.set(waiting)
