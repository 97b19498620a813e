"""bench/hops.py at a tiny size on the session's Ray Serve: every boundary is measured over
every transport with the asked number of samples, the bytes arrive intact (the bench checks
CRC32s and byte counts, and raises otherwise), and the bench's app is gone afterwards."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("ray.serve")

from ray import serve

from bench import hops


def test_every_hop_is_measured_on_every_transport(ray_http):
    rows = hops.run(iters=5, warmup=1, rounds=2, chunks=3)
    assert [r.case for r in rows] == list(hops.CASES)
    for r in rows:
        assert set(r.ms) == set(hops.CASES[r.case].transports)
        for t in r.ms:
            assert len(r.ms[t]) == 5, (r.case, t)
            assert all(math.isfinite(x) and x > 0 for x in r.ms[t]), (r.case, t, r.ms[t])
        assert r.fastest() in (*hops.TRANSPORTS, "same")
    assert rows[0].nbytes == (30 * 3 * 224 * 224 + 80 * 3000) * 4  # the 18 MB request + audio
    assert set(rows[0].ms) == {"inline", "ref"}  # over a replica's gRPC message limit
    assert all("grpc" in r.ms for r in rows[1:])
    table = hops.table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert all(line.count("|") == 14 for line in table)  # 13 columns
    assert hops.APP not in serve.status().applications


def test_the_verdict_follows_the_medians():
    def row(inline: list[float], ref: list[float], grpc: list[float]) -> hops.Row:
        return hops.Row(
            "codes",
            "Talker -> Code2Wav",
            200,
            "round trip",
            {"inline": inline, "ref": ref, "grpc": grpc},
        )

    assert row([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [3.0]).fastest() == "same"  # inline
    assert row([4.0, 5.0, 6.0], [1.0, 2.0, 3.0], [3.0]).fastest() == "ref"
    assert row([4.0, 5.0, 6.0], [3.0], [1.0, 2.0, 3.0]).fastest() == "grpc"
    assert row([10.0], [10.5], [9.5]).fastest() == "same"  # within the 10% margin
    assert row([10.0], [12.0], [5.0]).ratio("ref") == pytest.approx(1.2)
    assert row([10.0], [12.0], [5.0]).ratio("grpc") == pytest.approx(0.5)


def test_bad_arguments_are_refused_before_ray_is_touched():
    with pytest.raises(ValueError, match="unknown cases"):
        hops.run(only=["video"])
    with pytest.raises(ValueError, match="chunks <= 64"):
        hops.run(chunks=1)


def test_payloads_are_deterministic_and_sized_as_declared():
    for case in hops.CASES.values():
        a, b = hops.payload(case), hops.payload(case)
        assert hops.digest(a) == hops.digest(b)
        assert sum(x.nbytes for x in a.values()) == case.nbytes
        assert hops._touch(a) == case.nbytes
