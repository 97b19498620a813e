"""The GPU scripts' pieces that need no GPU: the schedules they feed, how they compare PCM,
codes and kernel timelines (the scripts themselves need CUDA)."""

from __future__ import annotations

import numpy as np
import pytest


def test_gpu_code2wav_schedule_feeds_each_stream_alone_in_the_same_rounds():
    """`only=i` gives stream i's pieces in the rounds it has together with the others: the
    same codes, the same boundaries, the same final piece."""
    from bench import gpu_code2wav

    together = gpu_code2wav.schedule([20, 19, 30], seed=3)
    assert [sum(len(p[1]) for r in together for p in r if p[0] == f"s{i}")
            for i in range(3)] == [20, 19, 30]
    assert [p[0] for p in together[0]] == ["s0"]  # stream i starts in round i
    assert {p[0] for p in together[2]} == {"s0", "s1", "s2"}
    for i in range(3):
        alone = gpu_code2wav.schedule([20, 19, 30], seed=3, only=i)
        assert len(alone) == len(together)
        for r_all, r_one in zip(together, alone):
            assert [p for p in r_all if p[0] == f"s{i}"] == r_one
        pieces = [p for r in alone for p in r]
        assert pieces[0][3] and pieces[-1][2] and not any(p[2] for p in pieces[:-1])


def test_gpu_code2wav_compare_reports_the_largest_difference_and_lowest_snr(capsys):
    from bench import gpu_code2wav

    ref = {"s0": [np.ones(4, np.float32)], "s1": [np.full(3, 0.5, np.float32)]}
    same = {k: [c.copy() for c in v] for k, v in ref.items()}
    worst, low = gpu_code2wav.compare(ref, same, "same")
    assert worst == 0.0 and low > 1000  # no error: the SNR of a 1e-300 floor
    other = {**same, "s1": [np.full(3, 0.5 + 1e-3, np.float32)]}
    worst, low = gpu_code2wav.compare(ref, other, "other")
    assert worst == pytest.approx(1e-3, rel=1e-3)
    assert low == pytest.approx(10 * np.log10(0.25 / 1e-6), abs=0.1)  # s1's 54 dB
    with pytest.raises(ValueError):  # a chunk missing is an error, not a pass
        gpu_code2wav.compare(ref, {**same, "s0": []}, "short")
    assert "other: max abs 1.00e-03" in capsys.readouterr().out


def test_gpu_code2wav_timeline_finds_where_no_kernel_runs():
    from bench import gpu_code2wav

    # kernels at [0, 10), [5, 12) overlapping, then [20, 25) and [40, 41): gaps of 8 and 15 us
    seq = [(0.0, "a", 10.0), (5.0, "b", 7.0), (20.0, "c", 5.0), (40.0, "d", 1.0)]
    got = gpu_code2wav.timeline(seq)
    assert got["span_ms"] == 0.041 and got["idle_ms"] == 0.023 and got["gaps"] == 2
    assert [(g["us"], g["at"], g["after"], g["before"]) for g in got["largest"]] == [
        (15.0, 3, "c", "d"), (8.0, 2, "b", "c")]
    assert gpu_code2wav.timeline([]) == {}


def test_gpu_talker_checks_codes_length_range_and_repeat():
    from bench import gpu_talker

    good = {1: {"codes": [[1, 2, 3]]}, 4: {"codes": [[4, 5, 6]] * 4}}
    assert gpu_talker.check_codes(good, {"codes": [[4, 5, 6]] * 4}, eos=10, want=3) == []
    bad = {1: {"codes": [[1, 2]]}, 4: {"codes": [[4, 5, 10]] * 4}}
    got = gpu_talker.check_codes(bad, {"codes": [[4, 5, 7]] * 4}, eos=10, want=3)
    assert got[0] == "batch 1 stream 0: 2 codes, max 2"
    assert sum("batch 4 stream" in g for g in got) == 4  # the EOS code is not a speech code
    assert got[-1] == "batch 4 run again: other codes for the same seeds"
