"""A GPU stage's start: its device, the memory check and cap under a per-GPU lock, what it
holds once built, and what it finds about how its GPU is shared."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from typing import Any

from deployments.config import GIB, AppConfig, MemoryBudgetError, check_memory_budget
from deployments.wire import error_line

log = logging.getLogger(__name__)

MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"

# What stage_init found for each stage this process hosts (one, under Serve), for stats().
_STARTED: dict[str, dict[str, Any]] = {}


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
    (this stage's free-memory reading taken while no other stage checks its own) and cap
    this process; then build the engine inside the `with` block, beside the other stages'
    builds (a check may read memory another stage is still filling; each stays under its
    cap). Once built, log and keep what the stage holds and how its GPU is shared."""
    device = resolve_device(cfg)
    if device != "cuda":
        yield device
        return
    import torch

    t0 = time.perf_counter()
    with one_at_a_time(f"/tmp/omniray-gpu{visible_gpu(os.environ)}-init.lock"):
        waited = time.perf_counter() - t0
        free, total = torch.cuda.mem_get_info()
        plan = check_memory_budget(cfg, total, free_bytes=free, stage=stage)
        frac = cfg.stages()[stage].memory_fraction
        if frac is not None:
            torch.cuda.set_per_process_memory_fraction(frac)
        log.info("%s: memory plan (GiB) %s", stage, {k: round(v, 2) for k, v in plan.items()})
    t1 = time.perf_counter()
    try:
        yield device
    except torch.OutOfMemoryError as e:
        raise MemoryBudgetError(out_of_cap(cfg, stage, total, e)) from e
    report = gpu_sharing()
    report["memory_gib"] = memory_at_start(plan[stage] or total / GIB)
    report["start_s"] = {"waited": round(waited, 1), "built": round(time.perf_counter() - t1, 1)}
    _STARTED[stage] = report
    log.info("%s: started on its GPU %s", stage, report)


def started(stage: str) -> dict[str, Any] | None:
    """What `stage_init` found for `stage` in this process (None on CPU)."""
    return _STARTED.get(stage)


@contextlib.contextmanager
def one_at_a_time(path: str) -> Iterator[None]:
    """An exclusive lock on the file at `path` (every process of the machine that opens it)
    over the block."""
    import fcntl

    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# What a stage holds beyond its model weights, the knob that sizes it: said when it runs out.
_MEMORY_HOLDERS = {
    "thinker": "thinker.kv_cache_gib (its KV cache)",
    "talker": "capacity (its slots)",
    "code2wav": "capacity or code2wav.engine.slot_prompt_frames (its slot pool)",
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


def visible_gpu(env: Mapping[str, str]) -> str:
    """The GPU this process uses (Ray sets CUDA_VISIBLE_DEVICES)."""
    return env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


def gpu_sharing(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """How this process shares its GPU, found without starting or changing anything: mps when
    an MPS control daemon answers on its pipe directory (the driver then makes its context
    an MPS client), else timeslice (the driver's default)."""
    up, where = mps_control(env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIR)
    return {"mode": "mps" if up else "timeslice", "mps_control": where if up else None}


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
