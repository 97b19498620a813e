"""A GPU stage's start: the memory check and cap under the per-GPU lock, the builds side by
side, the out-of-memory message, and the report of how the GPU is shared (an MPS daemon is
only found, never asked for).

On CPU: the detection against fake MPS pipe directories, the start-up ordering with the
CUDA calls stubbed, and CPU replicas reporting nothing. On CUDA (skipped elsewhere): the
report of a real start.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from test_api import light_source, user

from deployments.config import AppConfig
from deployments.stages import gpu
from deployments.stages.gpu import gpu_sharing, mps_control, stage_init
from deployments.wire import Done
from fakes import build_local_app

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("args", [
    {"gpu_sharing": "mps"}, {"stage_start": "serial"}, {"hold_for_first_audio": False},
    {"active_stream_window": 8}, {"ingress": {"prefetch_frames": False}},
    {"ingress": {"switch_interval_ms": 1}}, {"thinker": {"switch_interval_ms": 1}},
    {"talker": {"cuda_stream_priority": "high"}}, {"code2wav": {"mps_thread_percentage": 50}},
])
def test_deleted_knobs_are_unknown_keys(args):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppConfig.model_validate(args)


# ---------------------------------------------------------------------------------------
# What the stage finds about how its GPU is shared (nothing is started or changed)


@pytest.fixture
def pipe_dir():
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mps-", dir="/tmp") as d:
        yield Path(d)


def test_a_listening_control_socket_is_mps(pipe_dir):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # like the daemon's
        sock.bind(str(pipe_dir / "control"))
        sock.listen(4)
        assert mps_control(str(pipe_dir)) == (True, str(pipe_dir / "control"))
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
        assert gpu_sharing(env) == {"mode": "mps", "mps_control": str(pipe_dir / "control")}


def test_no_daemon_is_timeslice(pipe_dir):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    assert gpu_sharing(env) == {"mode": "timeslice", "mps_control": None}
    assert mps_control(str(pipe_dir)) == (False, f"no control socket at {pipe_dir}/control")


def test_a_stale_or_foreign_control_file_is_not_mps(pipe_dir):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(pipe_dir / "control"))  # the socket file of a daemon that is gone
    sock.close()
    up, why = mps_control(str(pipe_dir))
    assert not up and "does not answer" in why
    os.unlink(pipe_dir / "control")
    (pipe_dir / "control").write_text("")
    assert mps_control(str(pipe_dir)) == (False, f"{pipe_dir}/control is not a socket")


def test_stream_socket_listener_also_answers(pipe_dir):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(pipe_dir / "control"))
        sock.listen(1)
        assert mps_control(str(pipe_dir))[0]


# ---------------------------------------------------------------------------------------
# Start-up


def test_cpu_replicas_start_without_the_lock():
    with stage_init(AppConfig.model_validate({"device": "cpu"}), "talker") as device:
        assert device == "cpu"
    assert gpu.started("talker") is None


def fake_cuda(monkeypatch, lock_name: str) -> list[float]:
    """stage_init's CUDA calls stubbed: a GPU of 79.18 GiB, 79 free; the caps set, in order."""
    from deployments.config import GIB

    monkeypatch.setattr(gpu, "resolve_device", lambda cfg: "cuda")
    monkeypatch.setattr(gpu, "visible_gpu", lambda env: lock_name)  # the lock file's name
    monkeypatch.setattr(gpu, "memory_at_start", lambda cap: {"cap": cap})
    monkeypatch.setattr(gpu, "_STARTED", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (79 * GIB, int(79.18 * GIB)))
    caps: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", caps.append)
    return caps


def test_a_stage_that_outgrows_its_cap_while_starting_says_what_to_change(monkeypatch):
    """An out-of-memory error while a stage builds (its engine's warm-up included) becomes a
    MemoryBudgetError naming the stage's cap, the stages' split and the knobs to change."""
    from deployments.config import MemoryBudgetError

    cfg = AppConfig.model_validate({})
    caps = fake_cuda(monkeypatch, "-test-oom")
    with pytest.raises(MemoryBudgetError) as e, stage_init(cfg, "code2wav"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 434.00 MiB.")
    assert caps == [cfg.code2wav.memory_fraction]
    msg = str(e.value)
    assert msg.startswith("code2wav ran out of GPU memory while starting: its cap is 18.2 GiB")
    assert "thinker 0.55, talker 0.1, code2wav 0.23, 0.88 of 1" in msg
    assert "lower capacity or code2wav.engine.slot_prompt_frames" in msg
    assert "Tried to allocate 434.00 MiB" in msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)


def test_the_lock_covers_the_check_and_cap_and_the_builds_run_side_by_side(monkeypatch):
    """The per-GPU lock covers the memory check and the cap alone, so a second stage's build
    runs while the first one's still does (two threads here; in the app, two processes)."""
    import threading

    cfg = AppConfig.model_validate({})
    caps = fake_cuda(monkeypatch, "-test-parallel")
    first_building, first_may_finish, second_building = (threading.Event() for _ in range(3))

    def first():
        with stage_init(cfg, "thinker"):
            first_building.set()
            first_may_finish.wait(10)

    def second():
        first_building.wait(10)
        with stage_init(cfg, "talker"):
            second_building.set()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for th in threads:
        th.start()
    overlapped = second_building.wait(10)
    first_may_finish.set()
    for th in threads:
        th.join(10)
    assert overlapped
    assert set(gpu._STARTED) == {"thinker", "talker"}
    report = gpu.started("talker")  # in its stats: the start's parts and the sharing found
    assert report["start_s"]["waited"] < 0.5 and report["mode"] in ("timeslice", "mps")
    assert caps == [cfg.thinker.memory_fraction, cfg.talker.memory_fraction]


def test_the_shipped_split_fits_an_80_gb_gpu():
    from deployments.config import GIB, check_memory_budget

    plan = check_memory_budget(AppConfig.model_validate({}), int(79.18 * GIB))
    assert plan["need"] < plan["total"]
    # Code2Wav at capacity 8 peaks at 11.6 GiB and reserved 16.5 after c=8 (H100,
    # docs/performance.md "Memory"); the Thinker keeps ~6 GiB above its turns' peak for the
    # duplex speech weights and sessions (docs/operations.md "Capacity")
    assert plan["code2wav"] > 17.5 and plan["thinker"] > 43


def test_stages_on_cpu_report_no_gpu_and_their_capacity():
    cfg = {"device": "cpu", "capacity": 2}

    async def main():
        local = build_local_app(cfg, light_source())
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 8}
        events = [ev async for ev in local.ingress.chat(body)]
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return events, stats

    events, stats = asyncio.run(main())
    assert isinstance(events[-1], Done)
    for s in stats:
        assert s["gpu_sharing"] is None and s["health"] is None and s["capacity"] == 2, s


@needs_cuda
def test_stage_init_reports_what_the_stage_holds_and_how_the_gpu_is_shared():
    # no per-process memory cap: this test shares the pytest process with others
    cfg = AppConfig.model_validate({"device": "cuda", **{
        s: {"memory_fraction": None} for s in ("thinker", "talker", "code2wav")}})
    with stage_init(cfg, "talker") as device:
        assert device == "cuda"
        weights = torch.empty(32 * 2**20, device="cuda")  # 128 MiB: the report counts 0.12 GiB
    report = gpu.started("talker")
    assert report["mode"] in ("timeslice", "mps")
    mem = report["memory_gib"]  # what the stage holds once started, against its cap
    # (its peak is the process's, after other CUDA tests in the same process)
    assert 0.12 <= mem["allocated"] <= mem["reserved"] and mem["peak"] > 0 and mem["cap"] > 0
    del weights
