"""Profiles of engine steps inside the app (deployments/profiling.py): a loop profiles the
next steps it runs and hands them over; a stage's `profile()` returns them, or those that
ran before its timeout; the text form."""

from __future__ import annotations

import asyncio

import torch
from test_api import light_source, user

from deployments.stages.loop import EngineLoop
from deployments.stages.profiling import format_profile
from deployments.wire import Done
from fakes import build_local_app


class MatmulSteps:
    """An engine whose every step is a matmul, for `steps` steps."""

    def __init__(self, steps: int):
        self.left = steps

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        self.left -= 1
        x = torch.ones(64, 64)
        (x @ x).sum()
        return []


def test_a_loop_profiles_its_next_steps_then_stops():
    async def main():
        loop = EngineLoop(MatmulSteps(0), name="t", route=lambda o: ("k", o))
        prof = loop.profile(2)
        await loop.call(lambda e: setattr(e, "left", 5))
        steps = await asyncio.wait_for(asyncio.wrap_future(prof.done), 10)
        while loop.engine.has_work():
            await asyncio.sleep(0.01)
        loop.stop()
        return steps, loop

    steps, loop = asyncio.run(main())
    assert len(steps) == 2 and loop._profiler is None and loop.steps == 5
    for s in steps:
        assert s["wall_ms"] > 0 and "aten::mm" in [name for name, _, _ in s["top_host_ops"]]
        if not torch.cuda.is_available():
            assert s["kernels"] == 0 and s["top_kernels"] == []
    text = format_profile("t", steps)
    assert text.startswith("t: 2 engine steps profiled") and text.count("step ") == 2
    assert "aten::mm" in text


def test_a_stage_returns_the_steps_of_a_turn_or_those_before_its_timeout():
    body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 6}

    async def main():
        local = build_local_app({"capacity": 2}, light_source())
        profiled = asyncio.create_task(local.talker.profile(2, timeout_s=30))
        await asyncio.sleep(0)
        events = [ev async for ev in local.ingress.chat(body)]
        got = await profiled
        partial = await local.thinker.profile(10_000, timeout_s=0.2)  # nothing runs now
        return events, got, partial, local.thinker.loop._profiler

    events, got, partial, armed = asyncio.run(main())
    assert isinstance(events[-1], Done)
    assert got["stage"] == "talker" and len(got["steps"]) == 2
    assert all(s["wall_ms"] > 0 for s in got["steps"])
    assert partial == {"stage": "thinker", "steps": []} and armed is None
