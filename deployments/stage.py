"""What the three model deployments share: device and memory setup, engine construction,
the in-order forwarder to the next stage, and the small messages stages stream back.

Every stage call the ingress keeps open for a turn is a stream (Thinker.generate,
Talker.session, Code2Wav.stream), so the turn's state in a stage lives exactly as long as
that stream: a replica that dies fails its streams at once (the ingress ends the turn), and
a cancelled stream frees the state. Idle streams send a `Heartbeat` every
`timeouts.heartbeat_s` (or a `StageFailure` when the engine loop is wedged), so a stage that
is alive but stuck is told apart from one that is merely slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.config import GIB, AppConfig, MemoryBudgetError, check_memory_budget
from deployments.loop import StageFailure

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Messages streamed back to the ingress (small; payloads never come back this way)


@dataclass
class TextOut:
    """Thinker -> ingress: a text delta (possibly several engine steps coalesced)."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] | None = None  # the Thinker engine's wall-clock marks


@dataclass(frozen=True)
class NamedVoice:
    """A stored voice (POST /v1/audio/voices): its prompt is built once, kept for as long as
    the voice exists, and its initial-state template stays cached (pinned) in the engine."""

    voice_id: str
    samples: np.ndarray  # 16 kHz mono float32


# Serve sends a call through a replica's gRPC server when its handle says
# `_by_reference=False`: no Ray task and no object store, about half the time of an actor
# call for a small call or a streamed item (bench/hops.py). That server takes messages of
# up to 4 MiB, so calls carrying more than this go as actor calls, whose arrays pass
# through the object store without a copy.
GRPC_MAX_ARG_BYTES = 2 * 2**20


def set_switch_interval(ms: float | None, who: str) -> None:
    """This process's GIL switch interval (a replica's `switch_interval_ms`; None: Python's)."""
    if ms is not None:
        sys.setswitchinterval(ms / 1e3)
        log.info("%s: GIL switch interval %g ms", who, ms)


def via(handle: Any, grpc: bool, nbytes: int = 0) -> Any:
    """`handle` for a call carrying `nbytes` of arrays: over Serve's gRPC data plane if
    `grpc` (AppConfig.stage_transport) and they fit, else as a Ray actor call."""
    if grpc and nbytes <= GRPC_MAX_ARG_BYTES:
        return handle.options(_by_reference=False)
    return handle


@dataclass
class Opened:
    """First item of a speech stage's stream: the stage now holds the turn's state."""

    stage: str


@dataclass
class Heartbeat:
    """An open stream with nothing to say for `timeouts.heartbeat_s`; its engine loop is
    healthy."""

    stage: str


async def next_item(
    q: asyncio.Queue, loop: Any, stage: str, heartbeat_s: float, wedge_s: float
) -> Any:
    """The next item of a stream's queue, or a Heartbeat (StageFailure if the engine loop is
    wedged) when nothing comes within `heartbeat_s`."""
    if not q.empty():  # the common case while streaming: no timer, no task
        return q.get_nowait()
    try:
        return await asyncio.wait_for(q.get(), heartbeat_s)
    except asyncio.TimeoutError:
        problem = loop.health(wedge_s)
        if problem:
            return StageFailure(stage, problem, 503, "stage_unavailable")
        return Heartbeat(stage)


@dataclass
class AudioPiece:
    """Code2Wav -> ingress: mono float32 PCM at 24 kHz; is_last closes the stream."""

    pcm: np.ndarray
    is_last: bool
    t_start: float = 0.0  # wall clock of the engine step that produced it
    t_end: float = 0.0
    talker_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Device, memory, engine


def resolve_device(cfg: AppConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but this replica sees no GPU")
    return cfg.device


@contextlib.contextmanager
def stage_init(cfg: AppConfig, stage: str) -> Iterator[str]:
    """Pick the device and, on CUDA, under a per-GPU file lock: prove the memory plan fits
    (this stage's free-memory reading taken while no other stage checks its own), cap this
    process, then build the engine inside the `with` block (on the stage's engine stream).
    `stage_start: parallel` lets the lock go before the build, so the stages' builds and
    warm-ups run side by side; `serial` holds it over the build too. Once built, log and
    keep how the stage shares its GPU."""
    device = resolve_device(cfg)
    if device != "cuda":
        yield device
        return
    import torch

    t0 = time.perf_counter()
    with one_at_a_time(f"/tmp/omniray-gpu{visible_gpu(os.environ)}-init.lock") as release:
        waited = time.perf_counter() - t0
        free, total = torch.cuda.mem_get_info()
        plan = check_memory_budget(cfg, total, free_bytes=free, stage=stage)
        frac = cfg.stages()[stage].memory_fraction
        if frac is not None:
            torch.cuda.set_per_process_memory_fraction(frac)
        log.info("%s: memory plan (GiB) %s", stage, {k: round(v, 2) for k, v in plan.items()})
        if cfg.stage_start == "parallel":  # the build and warm-up beside the other stages'
            release()
        # The engine is built on the stream its thread will run on: its graphs are
        # captured at that stream's priority, its memory cached for that stream.
        stream = engine_stream(cfg, stage)
        t1 = time.perf_counter()
        with on_stream(stream):
            try:
                yield device
            except torch.OutOfMemoryError as e:
                raise MemoryBudgetError(out_of_cap(cfg, stage, total, e)) from e
        built = time.perf_counter() - t1
    # After the build: the CUDA context exists, so an MPS server serving it is listed.
    report = detect_gpu_sharing(cfg.gpu_sharing)
    report["cuda_stream_priority"] = 0 if stream is None else stream.priority
    report["memory_gib"] = memory_at_start(plan[stage] or total / GIB)
    # how long the stage waited for the stages before it (stage_start) and took to build
    report["start_s"] = {"waited": round(waited, 1), "built": round(built, 1)}
    _GPU_SHARING[stage] = report
    if report["warning"]:
        log.warning("%s: %s", stage, report["warning"])
    log.info("%s: GPU sharing %s", stage, report)


@contextlib.contextmanager
def one_at_a_time(path: str) -> Iterator[Callable[[], None]]:
    """An exclusive lock on the file at `path` (every process of the machine that opens it)
    over the block; the block may let it go early through the `release` it is given."""
    import fcntl

    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield functools.partial(fcntl.flock, lock, fcntl.LOCK_UN)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)  # a second unlock of the same file is a no-op


# What a stage holds beyond its model weights, the knob that sizes it: said when it runs out.
_MEMORY_HOLDERS = {
    "thinker": "thinker.kv_cache_gib (its KV cache)",
    "talker": "talker.engine.max_streams",
    "code2wav": "code2wav.engine.max_streams or slot_prompt_frames (its slot pool)",
}


def out_of_cap(cfg: AppConfig, stage: str, total_bytes: int, error: BaseException) -> str:
    """Why a stage could not start: its cap, the stages' split, and what to change."""
    s = cfg.stages()[stage]
    fracs = {name: st.memory_fraction or 0.0 for name, st in cfg.stages().items()}
    split = ", ".join(f"{name} {f:g}" for name, f in fracs.items())
    cap = (s.memory_fraction or 1.0) * total_bytes / GIB
    return (
        f"{stage} ran out of GPU memory while starting: its cap is {cap:.1f} GiB "
        f"({stage}.memory_fraction {s.memory_fraction} of {total_bytes / GIB:.1f} GiB; the "
        f"stages' fractions: {split}, {sum(fracs.values()):g} of 1). Raise "
        f"{stage}.memory_fraction (taking it from another stage if the sum would pass 1) or "
        f"lower {_MEMORY_HOLDERS[stage]}. ({error_line(error)})")


def memory_at_start(cap_gib: float) -> dict[str, float]:
    """This process's GPU memory once its engine is built and warmed up: what it holds, its
    peak while starting, what the allocator reserved, against its cap (GiB)."""
    import torch

    return {"allocated": round(torch.cuda.memory_allocated() / GIB, 2),
            "peak": round(torch.cuda.max_memory_allocated() / GIB, 2),
            "reserved": round(torch.cuda.memory_reserved() / GIB, 2),
            "cap": round(cap_gib, 2)}


def visible_gpu(env: Mapping[str, str]) -> str:
    """The GPU this process uses, as nvidia-smi names it (Ray sets CUDA_VISIBLE_DEVICES)."""
    return env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


# ---------------------------------------------------------------------------------------
# GPU sharing (time slicing or MPS) and the engine's CUDA stream

MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
NVIDIA_SMI_TIMEOUT_S = 2.0

# What stage_init found for each stage this process hosts (one, under Serve), for stats().
_GPU_SHARING: dict[str, dict[str, Any]] = {}


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
    """In a Serve replica (or with `force`): move everything alive after start-up (modules, weights' Python objects, graphs,
    tables) out of the collector's reach: a full collection then scans only what serving
    allocates. Measured: a Thinker process holds ~330k tracked objects after start-up and a
    full collection of them took 94-101 ms on the dev box (0 ms once frozen), up to 464 ms on
    the H200 machine, stopping the engine loop for that long. Collecting first leaves the
    start-up's own garbage out of the frozen set. Not in a shared process (tests build
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


def mps_control(pipe_dir: str) -> tuple[bool, str]:
    """Whether an MPS control daemon listens on `pipe_dir`/control, the socket the CUDA driver
    tries when it creates a context: (True, its path) or (False, why not). It connects and
    closes without sending anything, so nothing is started or changed."""
    path = os.path.join(pipe_dir, "control")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False, f"no control socket at {path}"
    except OSError as e:
        return False, f"{path}: {e.strerror}"
    if not stat.S_ISSOCK(mode):
        return False, f"{path} is not a socket"
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):  # the daemon's is SEQPACKET
        with socket.socket(socket.AF_UNIX, kind) as sock:
            sock.settimeout(0.5)
            try:
                sock.connect(path)
            except OSError as e:
                if e.errno == errno.EPROTOTYPE:  # a listener of the other socket type
                    continue
                return False, f"{path} does not answer ({e.strerror or e})"
            return True, path
    return False, f"{path} does not answer"


def _nvidia_smi(query: str, gpu: str, exe: str, timeout_s: float) -> list[str] | None:
    """One CSV query's lines, or None when nvidia-smi is missing, fails or does not answer."""
    try:
        out = subprocess.run(
            [exe, query, "-i", gpu, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def detect_gpu_sharing(
    requested: str,
    env: Mapping[str, str] = os.environ,
    *,
    nvidia_smi: str = "nvidia-smi",
    timeout_s: float = NVIDIA_SMI_TIMEOUT_S,
) -> dict[str, Any]:
    """How this process shares its GPU, found without starting or changing anything.

    `mode` is mps when an MPS control daemon answers on this process's pipe directory (the
    driver then makes its context an MPS client), else timeslice. nvidia-smi, if present,
    adds the GPU's compute mode and whether an MPS server is listed on it (None: unknown).
    `warning` says when what was found is not what `requested` asked for; it never fails."""
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIR
    up, where = mps_control(pipe_dir)
    gpu = visible_gpu(env)
    compute_mode = _nvidia_smi("--query-gpu=compute_mode", gpu, nvidia_smi, timeout_s)
    apps = _nvidia_smi("--query-compute-apps=process_name", gpu, nvidia_smi, timeout_s)
    listed = None if apps is None else any("nvidia-cuda-mps-server" in a for a in apps)
    warning = None
    if requested == "mps" and not up:
        hint = (
            " (an MPS server is listed on this GPU: does CUDA_MPS_PIPE_DIRECTORY match the "
            "daemon's?)"
            if listed
            else ""
        )
        warning = (
            f"gpu_sharing is mps but no MPS daemon found: {where}{hint}; this stage "
            f"time-slices the GPU with the other processes (an operator starts one "
            f"with `nvidia-cuda-mps-control -d` before Ray)"
        )
    elif requested != "mps" and up:
        warning = (
            f"an MPS daemon answers at {where}: this stage runs as an MPS client "
            f"although gpu_sharing is {requested}"
        )
    return {
        "requested": requested,
        "mode": "mps" if up else "timeslice",
        "mps_control": where if up else None,
        "mps_thread_percentage": env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "compute_mode": compute_mode[0] if compute_mode else None,
        "mps_server_listed": listed,
        "warning": warning,
    }


@functools.cache
def high_priority_stream() -> Any:
    """The process's high-priority CUDA stream: one, like the default stream, so a stage's
    build and its engine thread queue on the same stream."""
    import torch

    _, greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(priority=greatest)


def engine_stream(cfg: AppConfig, stage: str) -> Any:
    """The CUDA stream `stage`'s engine runs on: the high-priority one when its settings ask
    for it and it runs on CUDA; None (the default stream) otherwise, CPU included."""
    if cfg.stages()[stage].cuda_stream_priority != "high" or resolve_device(cfg) != "cuda":
        return None
    return high_priority_stream()


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Queue the block's CUDA work on `stream` (None: the current stream, nothing changes),
    after what this thread queued before the block and before what it queues after."""
    if stream is None:
        yield
        return
    import torch

    outer = torch.cuda.current_stream()
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)


def engine_scope(cfg: AppConfig, stage: str) -> Callable[[], AbstractContextManager]:
    """EngineLoop's `scope`: its thread runs every command and step on the stage's stream."""
    stream = engine_stream(cfg, stage)
    return lambda: on_stream(stream)


def device_memory() -> dict[str, float]:
    """This process's CUDA memory in GiB (empty on CPU), for stage stats."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        "gpu_allocated_gib": torch.cuda.memory_allocated() / GIB,
        "gpu_reserved_gib": torch.cuda.memory_reserved() / GIB,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB,
    }


def build_engine(
    engine_cls: Any, source: Any, engine_kwargs: dict[str, Any], device: str, config_cls: Any = None
) -> Any:
    """`engine_cls.from_source(source, config, device)`, the config validated from the
    stage's `engine:` settings (unknown keys fail here, at startup, with the key named) as
    `config_cls` (default: the engine class's own). With none (fakes: `config_cls = None`),
    the settings dict is passed as is."""
    config_cls = config_cls or engine_cls.config_cls
    config = (
        dict(engine_kwargs)
        if config_cls is None
        else dataclass_from_dict(config_cls, engine_kwargs, engine_cls.__name__)
    )
    return engine_cls.from_source(source, config, device)


def dataclass_from_dict(cls: Any, values: dict[str, Any], where: str) -> Any:
    """A frozen config dataclass from YAML values: nested configs from nested dicts,
    lists as tuples, unknown keys refused with the known ones listed."""
    defaults = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown engine settings {unknown}; known: {sorted(names)}")
    kwargs = {}
    for k, v in values.items():
        current = getattr(defaults, k)
        if isinstance(v, dict) and dataclasses.is_dataclass(current):
            v = dataclass_from_dict(type(current), v, f"{where}.{k}")
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def stage_stats(
    loop: Any, wedge_s: float, engine: dict[str, Any], held: int, leaks: list[str], **extra: Any
) -> dict[str, Any]:
    """What every stage's `stats()` reports: its open streams, the engine's stats, and the
    invariants: `idle` (no stream open and the engine holds nothing: `held` == 0), `leaks`
    (accounting that does not add up: `leaks` from the stage, plus an engine holding more
    than is open), `health` (None, or why the loop is unhealthy); `gpu_sharing` is what the
    stage found at start on its GPU (None on CPU)."""
    open_ = len(loop.open_keys)
    if held > open_:
        leaks = [f"engine holds {held} streams but {open_} are open", *leaks]
    return {
        "open": open_,
        **extra,
        "steps": loop.steps,
        "failures": loop.failures,
        "engine": engine,
        "idle": open_ == 0 and held == 0,
        "leaks": leaks,
        "health": loop.health(wedge_s),
        "pid": os.getpid(),
        "gpu_sharing": _GPU_SHARING.get(loop.name),
        "gc": gc_watch().stats(),
        **device_memory(),
    }


def check_loop_health(loop: Any, wedge_s: float) -> None:
    """Serve's `check_health`: raise while the engine loop is dead or wedged (Serve then
    replaces the replica, which ends its turns at once)."""
    problem = loop.health(wedge_s)
    if problem:
        raise RuntimeError(problem)


# ---------------------------------------------------------------------------------------
# In-order forwarding to the next stage


def one_each(item: Any) -> int:
    """A `Forwarder` chunk's default size: every chunk counts one."""
    return 1


class Forwarder:
    """Sends one stream's chunks to the next stage in order, one call in flight at a time.

    Chunks that arrive while a call is in flight are coalesced into the next call, so a
    slow hop batches instead of queueing. `hold` keeps everything until `finish()` (the
    Talker's full_span mode); `at_least` waits until the pending chunks' `size`s add up to
    it, or `finish()` (the Thinker sends the Talker whole text chunks: a unit starts only
    with one, so a row sent alone would only wait there, and cost both processes a call and
    the GPU the Talker's small launches between the Thinker's steps). `send(items, final)` is
    the hop, e.g. `talker.feed`; each call is bounded by `timeout_s`. A failed call drops the
    stream and reports to `on_error`, so the stream's owner ends the turn instead of waiting
    for chunks that will never come.
    """

    def __init__(
        self,
        send: Callable[[list[Any], bool], Awaitable[Any]],
        *,
        name: str,
        hold: bool = False,
        at_least: int = 1,
        size: Callable[[Any], int] = one_each,
        timeout_s: float | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self._send = send
        self._name = name
        self._hold = hold
        self._at_least, self._size = at_least, size
        self._pending = 0  # the `size`s of the chunks not sent yet
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._items: list[Any] = []
        self._final = False
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self.calls = 0

    def push(self, item: Any) -> None:
        self._items.append(item)
        self._pending += self._size(item)
        if not self._hold and self._pending >= self._at_least:
            self._wake.set()

    def finish(self) -> None:
        self._final = True
        self._wake.set()

    def cancel(self) -> None:
        self._task.cancel()

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self, timeout: float) -> bool:
        """Whether the last call returned (or the stream was dropped) within `timeout`."""
        done, _ = await asyncio.wait([self._task], timeout=timeout)
        return bool(done)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._items, self._pending = self._items, [], 0
            final = self._final
            if items or final:
                try:
                    await asyncio.wait_for(self._send(items, final), self._timeout_s)
                    self.calls += 1
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the next stage died, refused or hung
                    if isinstance(e, asyncio.TimeoutError):
                        e = TimeoutError(f"no answer within {self._timeout_s:g} s")
                    log.warning(
                        "%s: forwarding failed (%s); stream dropped", self._name, error_line(e)
                    )
                    if self._on_error is not None:
                        self._on_error(e)
                    return
            if final:
                return


def error_line(e: BaseException) -> str:
    """The innermost message of a (possibly Ray-wrapped) exception, on one short line."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"[:300]


class Tombstones:
    """Recently aborted request ids (bounded): an abort that overtakes its stream's open
    (both are concurrent calls) must still win, or the stream would never be closed."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids
