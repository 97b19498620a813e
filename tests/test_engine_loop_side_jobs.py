"""EngineLoop side jobs (`call_steps`): a generator advanced one step a loop iteration beside
the engine's steps, on the worker thread, with a fake engine (no model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.stages.loop import EngineLoop
from deployments.wire import TextDelta


class Counting:
    """An engine with `left` steps of work; each step is logged as "E" in `log`."""

    def __init__(self, log: list[str]):
        self.left, self.log = 0, log

    def has_work(self) -> bool:
        return self.left > 0

    def step(self, guests=None) -> list:
        if guests == "bad":
            raise RuntimeError("the step failed")
        self.left -= 1
        self.log.append("E" if guests is None else f"G{guests}")
        return [] if self.left else [TextDelta("done")]


def job(log: list[str], n: int, result="job done", fail_at: int | None = None):
    """A side job of `n` steps, each logged as "S"; raises at step `fail_at`."""
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"side step {i} failed")
        log.append("S")
        yield
    return result


def beside(log: list[str], left: int, steps):
    """A loop over a Counting engine with its stream "r" open, and the `call_steps` fn that
    gives the engine `left` steps of work as it starts the side job `steps`: both are ready
    at the same iteration."""
    loop = EngineLoop(Counting(log), name="t", route=lambda d: ("r", d))
    q = loop.open("r")

    def start(e):
        e.left = left
        return steps

    return loop, q, start


def test_side_steps_alternate_with_engine_steps_and_return_the_job_result():
    log: list[str] = []

    async def main():
        loop, q, start = beside(log, 3, job(log, 5))
        result = await asyncio.wait_for(loop.call_steps(start), 5)
        out = await asyncio.wait_for(q.get(), 5)
        loop.stop()
        return result, out, loop

    result, out, loop = asyncio.run(main())
    assert result == "job done" and out.text == "done"
    assert "".join(log) == "SESESESS"  # one side step, one engine step, then the job alone
    assert loop.steps == 3 and loop.side_steps == 6  # the sixth next() returns


def test_a_failed_side_step_fails_its_job_only():
    log: list[str] = []

    async def main():
        loop, q, start = beside(log, 4, job(log, 5, fail_at=2))
        with pytest.raises(RuntimeError, match="side step 2 failed"):
            await asyncio.wait_for(loop.call_steps(start), 5)
        out = await asyncio.wait_for(q.get(), 5)  # the engine's stream goes on to its end
        with pytest.raises(ZeroDivisionError):  # fn(engine) itself raising reaches the caller
            await asyncio.wait_for(loop.call_steps(lambda e: 1 / 0), 5)
        after = await asyncio.wait_for(loop.call_steps(lambda e: job(log, 1, "next")), 5)
        alive = loop.alive
        loop.stop()
        return out, after, alive, loop.failures

    out, after, alive, failures = asyncio.run(main())
    assert out.text == "done" and after == "next"
    assert failures == 0 and alive
    assert "".join(log) == "SESEEES"


def test_a_side_step_may_run_the_iterations_engine_step_with_its_rows():
    """`guest_step` from a side step: the engine's step with the side job's rows, its
    outputs routed as any step's; the iteration then runs no other engine step. With no
    work of its own the engine still runs them."""
    log: list[str] = []

    def with_rows(loop, n):
        for i in range(n):
            log.append("S")
            if i % 2 == 0:
                loop.guest_step(i)
            yield
        return "fused"

    async def main():
        loop = EngineLoop(Counting(log), name="t", route=lambda d: ("r", d))
        q = loop.open("r")

        def start(e):
            e.left = 4
            return with_rows(loop, 5)

        result = await asyncio.wait_for(loop.call_steps(start), 5)
        out = await asyncio.wait_for(q.get(), 5)
        loop.stop()
        return result, out, loop

    result, out, loop = asyncio.run(main())
    assert result == "fused" and out.text == "done"
    # side steps 0, 2 and 4 run the engine's step with their rows (the last with the
    # engine's own work done), 1 and 3 leave the iteration's step to the loop
    assert log == ["S", "G0", "S", "E", "S", "G2", "S", "E", "S", "G4"]
    assert loop.guest_steps == 3 and loop.steps == 5


def test_a_failed_guest_step_fails_the_engines_streams_and_the_side_job():
    log: list[str] = []

    def bad_rows(loop):
        log.append("S")
        loop.guest_step("bad")
        yield

    async def main():
        loop = EngineLoop(Counting(log), name="t", route=lambda d: ("r", d))
        q = loop.open("r")
        with pytest.raises(RuntimeError, match="the step failed"):
            await asyncio.wait_for(loop.call_steps(lambda e: bad_rows(loop)), 5)
        failure = await asyncio.wait_for(q.get(), 5)
        alive = loop.alive
        loop.stop()
        return failure, alive, loop.failures

    failure, alive, failures = asyncio.run(main())
    assert type(failure).__name__ == "StageFailure" and "the step failed" in failure.message
    assert failures == 1 and alive


def test_an_idle_engine_does_not_block_on_commands_while_a_side_job_is_live():
    """With no engine work the side job's steps follow each other, the commands still run
    between them, and the loop never waits for a command while the job is live."""
    waits: list[tuple[bool, bool]] = []  # (job live, blocking) per command poll
    log: list[str] = []

    async def main():
        engine = Counting(log)
        loop = EngineLoop(engine, name="t", route=lambda d: ("r", d))
        run = loop._run_commands

        def recording(block, timeout):
            waits.append((bool(loop._jobs), block))
            return run(block, timeout)

        loop._run_commands = recording

        def until_command():
            while "C" not in log:  # steps on until the command below has run between two
                time.sleep(0.001)
                log.append("S")
                yield
            for _ in range(3):
                log.append("S")
                yield
            return "ok"

        task = asyncio.ensure_future(loop.call_steps(lambda e: until_command()))
        while loop.side_steps < 3:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(loop.call(lambda e: log.append("C")), 5)  # a command mid-job
        result = await asyncio.wait_for(task, 5)
        loop.stop()
        return result

    result = asyncio.run(main())
    assert result == "ok"
    c = log.index("C")
    assert c >= 3 and log[c + 1 :] == ["S"] * 3
    assert (True, False) in waits and (True, True) not in waits


def test_a_cancelled_callers_job_still_runs_to_its_end():
    log: list[str] = []

    async def main():
        engine = Counting(log)
        loop = EngineLoop(engine, name="t", route=lambda d: ("r", d))

        def slow(n):
            for _ in range(n):
                time.sleep(0.01)
                log.append("S")
                yield
            log.append("end")
            return "dropped"

        task = asyncio.ensure_future(loop.call_steps(lambda e: slow(10)))
        await asyncio.sleep(0.03)
        task.cancel()  # the caller goes away mid-job
        with pytest.raises(asyncio.CancelledError):
            await task
        # the next job waits for it: one job at a time, in order
        second = await asyncio.wait_for(loop.call_steps(lambda e: job(log, 2, "second")), 5)
        loop.stop()
        return second

    second = asyncio.run(main())
    assert second == "second"
    assert log == ["S"] * 10 + ["end", "S", "S"]


def test_a_stuck_side_step_fails_health():
    async def main():
        loop = EngineLoop(Counting([]), name="t", route=lambda d: ("r", d))

        def stuck():
            time.sleep(0.4)
            yield

        task = asyncio.ensure_future(loop.call_steps(lambda e: stuck()))
        await asyncio.sleep(0.25)
        during = loop.health(0.1)
        await asyncio.wait_for(task, 5)
        after = loop.health(0.1)
        loop.stop()
        return during, after

    during, after = asyncio.run(main())
    assert during and "side step" in during
    assert after is None
