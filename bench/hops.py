"""The stage hops on Ray Serve: inline numpy arguments over Ray actor calls (Serve's default),
an ObjectRef that the producer puts once and passes inside a small header, and inline
arguments over Serve's gRPC data plane between replicas.

Two toy deployments (zero CPUs, like the stages): `Caller` holds a DeploymentHandle to
`Callee` and times, inside its replica, the hop at each stage boundary with that boundary's
payload:
  * calls (ingress -> Thinker request, Thinker -> Talker feed, Talker -> Code2Wav push):
    round trip from the producer holding the payload to the callee's answer.
    inline: `callee.take.remote(rid, payload, final, meta)` (Ray puts args over 100 KiB
    into the object store itself); ref: `ray.put(payload)`, then
    `callee.take_ref.remote(Header(rid, final, meta, ref))` and the callee awaits the ref;
    grpc: the inline call through `callee.options(_by_reference=False)`, which Serve sends
    to the replica's gRPC server (pickled arguments, no Ray task, no object store).
    Both ends read the arrays' last elements (the callee answers their byte count).
  * the streamed PCM (Code2Wav -> ingress): `Callee.stream` yields `Piece`s holding the numpy
    chunk (inline, grpc) or a ref it put (ref). "paced": chunks 10 ms apart, one-way ms from the
    producer starting the hand-over to the reader holding the array (one host, one clock);
    "back to back": ms between arrivals when the producer never waits. The producer holds
    the last 256 refs it streamed alive (see `Callee.__init__`).
Before timing, each case checks once that the bytes arrive intact (CRC32 of every array).
The transports take turns in rounds (reversed every other round) so that load from other
work hits all alike.

    python -m bench.hops [--iters 300] [--warmup 10] [--rounds 6] [--only media,codes]
                         [--json F.json]

Reuses a Ray that is already initialised in the process (the test session's) under its own
app name with no route, and deletes the app after; otherwise starts a small local one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import ray
from ray import serve

APP = "omniray-hops-bench"
TRANSPORTS = ("inline", "ref", "grpc")
# A replica's gRPC server takes messages up to 4 MiB by default (Serve's
# RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH): larger payloads are not measured over grpc.
GRPC_MAX_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    boundary: str
    arrays: tuple[tuple[str, tuple[int, ...], str], ...]  # (field, shape, dtype)
    stream_gap_s: float | None = None  # None: a call; else a stream with this pause per chunk

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in self.arrays)

    @property
    def transports(self) -> tuple[str, ...]:
        return TRANSPORTS if self.nbytes < GRPC_MAX_BYTES else ("inline", "ref")

    @property
    def measure(self) -> str:
        if self.stream_gap_s is None:
            return "round trip"
        return "one-way, paced" if self.stream_gap_s > 0 else "per chunk, back to back"


HIDDEN = 4096  # the Thinker's hidden size (float32 on the hop)
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        # 30 frames of pixel values (~18 MB of float32) plus 30 s of mel features
        Case(
            "media",
            "ingress -> Thinker",
            (
                ("pixel_values", (30, 3, 224, 224), "float32"),
                ("audio_features", (80, 3000), "float32"),
            ),
        ),
        Case("hidden1", "Thinker -> Talker", (("hidden", (1, HIDDEN), "float32"),)),
        Case("hidden10", "Thinker -> Talker", (("hidden", (10, HIDDEN), "float32"),)),
        Case("hidden30", "Thinker -> Talker", (("hidden", (30, HIDDEN), "float32"),)),
        Case("codes", "Talker -> Code2Wav", (("codes", (25,), "int64"),)),
        Case("pcm", "Code2Wav -> ingress", (("pcm", (24000,), "float32"),), stream_gap_s=0.01),
        Case("pcm-burst", "Code2Wav -> ingress", (("pcm", (24000,), "float32"),), stream_gap_s=0.0),
    )
}


def payload(case: Case) -> dict[str, np.ndarray]:
    """Deterministic arrays of the case's shapes, so the reader can check what arrived."""
    out = {}
    for field, shape, dtype in case.arrays:
        n = math.prod(shape)
        out[field] = (np.arange(n, dtype=np.int64) % 251).astype(dtype).reshape(shape)
    return out


def digest(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    return {k: zlib.crc32(np.ascontiguousarray(a).tobytes()) for k, a in arrays.items()}


def _touch(arrays: dict[str, np.ndarray]) -> int:
    """What a stage does first with its payload: look at it. Reading the last element makes
    sure the buffer is mapped; the byte count tells the caller what arrived."""
    for a in arrays.values():
        a.reshape(-1)[-1].item()
    return sum(a.nbytes for a in arrays.values())


def _meta(case: Case) -> list:
    """The small typed fields that travel beside a payload today (spoken ids, Talker spans)."""
    if case.name.startswith("hidden"):
        return list(range(case.arrays[0][1][0]))
    if case.name == "codes":
        return [(0.0, 0.01)]
    return []


@dataclasses.dataclass(frozen=True)
class Header:
    """What crosses the call with the ref transport. The ref sits inside this object, not as
    a top-level argument, so Ray hands it over as a ref instead of resolving it first."""

    rid: str
    final: bool
    meta: list
    ref: ray.ObjectRef


@dataclasses.dataclass(frozen=True)
class Piece:
    """One streamed chunk: `data` is the arrays (inline) or a ref to them (ref)."""

    seq: int
    sent: float  # time.time() when the producer began handing this chunk over
    data: Any


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Callee:
    """The receiving stage of a call, and the producing stage of the PCM stream."""

    def __init__(self) -> None:
        # Ray 2.60 can free a ref nested in a streamed item before the reader resolves it
        # (ReferenceCountingAssertionError; ray-project/ray#58080), so the producer keeps
        # the last refs it streamed alive itself; the reader is never this far behind.
        self.held: collections.deque[ray.ObjectRef] = collections.deque(maxlen=256)

    async def take(self, rid: str, arrays: dict[str, np.ndarray], final: bool, meta: list) -> int:
        return _touch(arrays)

    async def take_ref(self, head: Header) -> int:
        return _touch(await head.ref)

    async def digest(
        self, rid: str, arrays: dict[str, np.ndarray], final: bool, meta: list
    ) -> dict[str, int]:
        return digest(arrays)

    async def digest_ref(self, head: Header) -> dict[str, int]:
        return digest(await head.ref)

    async def stream(self, case_name: str, chunks: int, by_ref: bool) -> AsyncIterator[Piece]:
        case = CASES[case_name]
        arrays = payload(case)
        for i in range(chunks):
            sent = time.time()
            if by_ref:
                self.held.append(ray.put(arrays))
            yield Piece(i, sent, self.held[-1] if by_ref else arrays)
            await asyncio.sleep(case.stream_gap_s or 0.0)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    """The producing stage of a call, and the reader (the ingress) of the PCM stream."""

    def __init__(self, callee: Any) -> None:
        self.callee = callee

    async def check(self, case_name: str, transport: str) -> None:
        """Raises unless the callee (or this reader) got the exact bytes."""
        case = CASES[case_name]
        arrays, by_ref, callee = payload(case), transport == "ref", self._via(transport)
        want = digest(arrays)
        if case.stream_gap_s is not None:
            got = [
                await self._arrays(p, by_ref)
                async for p in callee.options(stream=True).stream.remote(case_name, 2, by_ref)
            ]
            seen = [digest(a) for a in got]
        elif by_ref:
            head = Header("check", True, _meta(case), ray.put(arrays))
            seen = [await callee.digest_ref.remote(head)]
        else:
            seen = [await callee.digest.remote("check", arrays, True, _meta(case))]
        if not seen or any(s != want for s in seen):
            raise RuntimeError(f"{case_name}/{transport}: payload changed on the hop")

    def _via(self, transport: str) -> Any:
        """The callee's handle for `transport`: Serve's gRPC data plane for grpc."""
        return self.callee.options(_by_reference=False) if transport == "grpc" else self.callee

    @staticmethod
    async def _arrays(piece: Piece, by_ref: bool) -> dict[str, np.ndarray]:
        return await piece.data if by_ref else piece.data

    async def measure(
        self, case_name: str, transport: str, iters: int, warmup: int, chunks: int
    ) -> list[float]:
        """`iters` samples in ms after `warmup` discarded ones."""
        case = CASES[case_name]
        callee, by_ref = self._via(transport), transport == "ref"
        if case.stream_gap_s is not None:
            out = await self._stream(callee, case, by_ref, iters + warmup, chunks)
        else:
            out = await self._calls(callee, case, by_ref, iters + warmup)
        return out[warmup:]

    async def _calls(self, callee: Any, case: Case, by_ref: bool, n: int) -> list[float]:
        arrays, meta, nbytes = payload(case), _meta(case), case.nbytes
        out = []
        for i in range(n):
            rid = f"r{i}"
            t0 = time.perf_counter()
            if by_ref:
                got = await callee.take_ref.remote(Header(rid, False, meta, ray.put(arrays)))
            else:
                got = await callee.take.remote(rid, arrays, False, meta)
            out.append((time.perf_counter() - t0) * 1e3)
            if got != nbytes:
                raise RuntimeError(f"{case.name}: callee saw {got} bytes, sent {nbytes}")
        return out

    async def _stream(
        self, callee: Any, case: Case, by_ref: bool, n: int, chunks: int
    ) -> list[float]:
        out: list[float] = []
        paced = bool(case.stream_gap_s)
        while len(out) < n:
            last = None
            async for p in callee.options(stream=True).stream.remote(case.name, chunks, by_ref):
                _touch(await self._arrays(p, by_ref))
                now = time.time()
                if paced:
                    out.append((now - p.sent) * 1e3)
                elif last is not None:  # the first arrival also pays for the stream's open
                    out.append((now - last) * 1e3)
                last = now
        return out[:n]


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    boundary: str
    nbytes: int
    measure: str
    ms: dict[str, list[float]]  # transport -> samples

    def stat(self, transport: str, q: float) -> float:
        return float(np.percentile(self.ms[transport], q))

    def ratio(self, transport: str) -> float:
        """Median of `transport` over the median of inline (Serve's default)."""
        return self.stat(transport, 50) / self.stat("inline", 50)

    def fastest(self, margin: float = 0.10) -> str:
        """The transport with the lowest median; "same" when none is more than `margin`
        faster than inline (noise on a busy box)."""
        best = min(self.ms, key=lambda t: self.stat(t, 50))
        return best if self.ratio(best) < 1.0 - margin else "same"


def ensure_ray(http_port: int | None = None) -> bool:
    """A small local Ray + Serve unless one runs in this process (HTTP on 127.0.0.1:http_port,
    or no proxy); True if this call started it (the caller shuts it down again)."""
    if ray.is_initialized():
        return False
    for k, v in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
    ):
        os.environ.setdefault(k, v)
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20
    )
    if http_port is None:
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return True


def run(
    iters: int = 300,
    warmup: int = 10,
    rounds: int = 6,
    chunks: int = 10,
    only: list[str] | None = None,
) -> list[Row]:
    names = only or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {sorted(CASES)}")
    if iters < 1 or warmup < 0 or rounds < 1 or not 2 <= chunks <= 64:
        raise ValueError("need iters >= 1, warmup >= 0, rounds >= 1, 2 <= chunks <= 64")
    started = ensure_ray()
    try:
        caller = serve.run(Caller.bind(Callee.bind()), name=APP, route_prefix=None)
        try:
            rows = []
            for name in names:
                c = CASES[name]
                for t in c.transports:
                    caller.check.remote(name, t).result(timeout_s=120)
                ms: dict[str, list[float]] = {t: [] for t in c.transports}
                per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
                for r, k in enumerate(per_round):
                    if k == 0:
                        continue
                    for t in c.transports if r % 2 == 0 else c.transports[::-1]:
                        ms[t] += caller.measure.remote(name, t, k, warmup, chunks).result(
                            timeout_s=600
                        )
                rows.append(Row(name, c.boundary, c.nbytes, c.measure, ms))
            return rows
        finally:
            serve.delete(APP)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


def _size(n: int) -> str:
    for unit, f in (("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n} B"


def table(rows: list[Row]) -> str:
    others = [t for t in TRANSPORTS if t != "inline"]
    head = (
        "| boundary | payload | bytes | measure | "
        + " | ".join(f"{t} median | {t} p90" for t in TRANSPORTS)
        + " | "
        + " | ".join(f"{t} / inline" for t in others)
        + " | fastest |"
    )
    lines = [head, "|" + "---|" * (5 + 2 * len(TRANSPORTS) + len(others))]
    for r in rows:
        shapes = ", ".join(f"{d} {'x'.join(map(str, s))}" for _, s, d in CASES[r.case].arrays)
        cells = [
            f"{r.stat(t, 50):.2f} | {r.stat(t, 90):.2f}" if t in r.ms else "- | -"
            for t in TRANSPORTS
        ]
        cells += [f"{r.ratio(t):.2f}" if t in r.ms else "-" for t in others]
        lines.append(
            f"| {r.boundary} | {r.case}: {shapes} | {_size(r.nbytes)} | {r.measure} | "
            + " | ".join(cells)
            + f" | {r.fastest()} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300, help="timed samples per case and transport")
    p.add_argument("--warmup", type=int, default=10, help="discarded samples per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds the transports take turns in")
    p.add_argument("--chunks", type=int, default=10, help="chunks per PCM stream")
    p.add_argument("--only", default="", help=f"comma list of {','.join(CASES)}")
    p.add_argument("--json", default="", help="write the raw samples here")
    a = p.parse_args(argv)
    only = [s for s in a.only.split(",") if s] or None
    rows = run(a.iters, a.warmup, a.rounds, a.chunks, only)
    print(f"{a.iters} samples per cell in {a.rounds} rounds, {a.warmup} warm-up per round; ms")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f)
    return 0


if __name__ == "__main__":
    from bench.hops import main as _main  # the replicas import bench.hops, not __main__

    raise SystemExit(_main())
