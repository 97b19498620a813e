"""Benchmark metrics: exact definitions on hand-made records, and measured values against the
scripted fake server (127.0.0.1, ephemeral port) whose timings are known."""

from __future__ import annotations

import asyncio
import base64
import io
import struct

import numpy as np
import pytest
import soundfile as sf

from bench.client import (
    BenchConfig,
    ClientOptions,
    RequestSpec,
    SSEParser,
    audio_chunk_seconds,
    build_payload,
    run_benchmark,
)
from tests.fake_server import FakeScript, FakeServerThread, pcm_wav
from bench.metrics import AudioEvent, RequestRecord, RoundResult, summarize, wav_frames

# Timing checks against the scripted server. A client can never see an event before the server
# scheduled it, so every measured latency is >= the scripted one (EPS for float noise); delays
# only add, so on a loaded machine the *fastest* request is the one compared with the script
# (within TOL_S: localhost plus a shared 2-core machine).
TOL_S = 0.05
EPS_S = 0.002

SPEC = [RequestSpec("item0", [{"role": "user", "content": "hello"}], answer="B")]


def _bounded(values, expected: float, what: str, tol: float = TOL_S, eps: float = EPS_S) -> None:
    """All values >= expected (never early) and the fastest within tol of it."""
    lo, hi = min(values), max(values)
    assert lo >= expected - eps, f"{what}: {lo:.4f} is earlier than the script's {expected:.4f}"
    assert lo <= expected + tol, (
        f"{what}: fastest {lo:.4f} vs scripted {expected:.4f} (diff {lo - expected:+.4f}, "
        f"tol {tol}; slowest {hi:.4f})"
    )


def _run(url: str, cfg: BenchConfig, **opt_kw):
    opts = ClientOptions(url=url, retries=0, **opt_kw)
    return asyncio.run(run_benchmark(SPEC, opts, cfg))


# ----------------------------------------------------------------------------- pure functions


def test_wav_frames_header_and_streaming_sizes():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(36000, dtype=np.float32), 24000, format="WAV", subtype="PCM_16")
    raw = buf.getvalue()
    assert wav_frames(raw) == (36000, 24000)
    # streaming writers leave the data size at 0xFFFFFFFF: count the bytes present instead
    pos = raw.find(b"data")
    streamed = raw[: pos + 4] + struct.pack("<I", 0xFFFFFFFF) + raw[pos + 8 :]
    assert wav_frames(streamed) == (36000, 24000)
    assert wav_frames(pcm_wav(0.28, 24000)) == (6720, 24000)
    with pytest.raises(ValueError):
        wav_frames(b"not a wav file at all")


def test_audio_chunk_seconds_from_wav_and_metadata():
    b64 = base64.b64encode(pcm_wav(1.0, 16000)).decode()
    chunk = {"modality": "audio", "choices": [{"delta": {"content": b64}}]}
    assert audio_chunk_seconds(chunk) == pytest.approx(1.0, abs=1e-9)
    alt = {"modality": "audio", "choices": [{"delta": {"audio": {"data": b64}}}]}
    assert audio_chunk_seconds(alt) == pytest.approx(1.0, abs=1e-9)
    meta_only = {"modality": "audio", "choices": [{"delta": {}}],
                 "audio_metadata": {"frame_count": 12000, "sample_rate_hz": 24000}}
    assert audio_chunk_seconds(meta_only) == pytest.approx(0.5, abs=1e-9)


def test_sse_parser_handles_arbitrary_splits_and_crlf():
    stream = (b'data: {"a": 1}\r\n\r\n: comment\n\ndata: {"b": 2}\n\n'
              b"data: [DONE]\n\n")
    for cut in range(1, len(stream)):
        p = SSEParser()
        got = p.feed(stream[:cut]) + p.feed(stream[cut:]) + p.flush()
        assert got == ['{"a": 1}', '{"b": 2}', "[DONE]"], f"split at {cut}: {got}"


def test_build_payload_fixed_length_and_timings():
    opts = ClientOptions(fixed_text_tokens=16, fixed_speech_codes=57, max_tokens=256)
    body = build_payload(SPEC[0], opts)
    assert body["stream"] is True
    assert body["modalities"] == ["text", "audio"]
    assert body["audio"] == {"format": "wav"}
    assert body["omniray"] == {"return_timings": True, "ignore_eos": True,
                               "fixed_text_tokens": 16, "fixed_speech_codes": 57,
                               "stream_format": "vllm-omni"}  # the shape the client reads
    # vLLM-style fallback: ignore_eos + max_tokens = N gives exactly N tokens
    assert body["ignore_eos"] is True and body["max_tokens"] == 16
    plain = build_payload(SPEC[0], ClientOptions(return_timings=False, modalities=("text",)))
    assert plain["omniray"] == {"stream_format": "vllm-omni"}
    assert "audio" not in plain and "ignore_eos" not in plain


def _rec(i: int, send: float, ttft: float, ttfp: float, chunks, end: float, tokens: int = 5):
    r = RequestRecord(f"r{i}", t_send=send, t_first_text=send + ttft, t_first_audio=send + ttfp,
                      t_end=send + end, usage={"completion_tokens": tokens})
    r.audio_events = [AudioEvent(send + t, s) for t, s in chunks]
    r.text_events = [send + ttft]
    r.timings = {"spans": [{"stage": "queue", "start": 0.0, "end": 0.01 * i},
                           {"stage": "code2wav", "start": 0.2, "end": 0.25},
                           {"stage": "code2wav", "start": 0.3, "end": 0.32}]}
    return r


def test_summarize_exact_values():
    # two rounds, hand-made timelines: every metric is known exactly
    r0 = [_rec(0, 0.0, 0.1, 0.2, [(0.2, 1.0), (0.4, 1.0)], 0.5),
          _rec(1, 0.5, 0.3, 0.5, [(0.5, 1.0), (1.0, 1.0)], 1.5)]
    r1 = [_rec(2, 10.0, 0.2, 0.4, [(0.4, 2.0)], 1.0),
          _rec(3, 11.0, 0.4, 0.6, [(0.6, 0.5), (0.9, 0.5)], 1.0)]
    failed = RequestRecord("bad", t_send=11.0, error="HTTP 500")
    rounds = [RoundResult(2, 0, 0.0, 2.0, r0), RoundResult(2, 1, 10.0, 12.0, r1 + [failed])]
    s = summarize(rounds, percentiles=(50, 90))
    assert s["completed"] == 4 and s["failed"] == 1 and s["num_rounds"] == 2
    assert s["ttft_ms"]["median"] == pytest.approx(250.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(np.percentile([100, 300, 200, 400], 90))
    assert s["audio_ttfp_ms"]["median"] == pytest.approx(450.0)
    # RTF = last audio / audio seconds: 0.4/2, 1.0/2, 0.4/2, 0.9/1
    assert s["audio_rtf"]["median"] == pytest.approx(np.median([0.2, 0.5, 0.2, 0.9]))
    assert s["audio_rtf"]["max"] == pytest.approx(0.9)
    assert s["e2el_ms"]["median"] == pytest.approx(1000.0)
    # TPOT = (E2E - TTFT) / (tokens - 1)
    assert s["tpot_ms"]["min"] == pytest.approx((0.5 - 0.1) / 4 * 1e3)
    # throughput per round, then median: round 0: 2 req / 2 s, 4 audio-s / 2 s; round 1: 2 / 2
    assert s["per_round"][0]["request_throughput"] == pytest.approx(1.0)
    assert s["per_round"][0]["audio_throughput"] == pytest.approx(2.0)
    assert s["per_round"][1]["audio_throughput"] == pytest.approx(1.5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["audio_throughput"] == pytest.approx(1.75)
    # stage durations: code2wav spans summed per request (0.05 + 0.02 s)
    assert s["stages_ms"]["code2wav"]["median"] == pytest.approx(70.0)
    assert list(s["stages_ms"]) == ["queue", "code2wav"]


def test_where_the_first_audio_was_made_from_the_spans():
    """first_audio_ms: the first token (decode span start), the Talker's chunk 0, the
    Code2Wav step of chunk 0 and the ingress's own first audio, per request then medians;
    the report's table shows them beside the client's TTFP, and is left out for runs
    without speech spans."""
    from bench.report import format_first_audio

    recs = []
    for i, shift in enumerate((0.0, 0.010, 0.030)):
        r = _rec(i, float(i), 0.2, 0.4 + shift, [(0.4 + shift, 1.0)], 1.0)
        r.timings = {"spans": [
            {"stage": "prefill", "start": 0.1, "end": 0.2},
            {"stage": "decode", "start": 0.2 + shift, "end": 0.3},
            {"stage": "talker", "start": 0.25 + shift, "end": 0.3 + shift, "chunk": 0},
            {"stage": "talker", "start": 0.3 + shift, "end": 0.5, "chunk": 1},
            {"stage": "code2wav", "start": 0.31 + shift, "end": 0.38 + 2 * shift, "chunk": 0},
            {"stage": "code2wav", "start": 0.5, "end": 0.55, "chunk": 1}]}
        r.server_metrics = {"first_audio_s": 0.39 + 2 * shift, "ttft_s": 0.2}
        recs.append(r)
    s = summarize([RoundResult(1, 0, 0.0, 3.0, recs)], percentiles=(50,))
    fa = s["first_audio_ms"]
    assert list(fa) == ["first_token", "talker_start", "talker_released", "code2wav_start",
                        "code2wav_end", "talker", "code2wav", "ingress"]
    assert fa["first_token"]["median"] == pytest.approx(210.0)
    assert fa["talker_start"]["median"] == pytest.approx(260.0)
    assert fa["talker"]["median"] == pytest.approx(50.0)
    assert fa["code2wav_end"]["median"] == pytest.approx(400.0)
    assert fa["code2wav"]["median"] == pytest.approx(80.0)
    run = {"summaries": {"1": s}}
    table = format_first_audio(run)
    assert fa["ingress"]["median"] == pytest.approx(410.0)  # the ingress's own first audio
    assert "260.0 -> 310.0" in table and "320.0 -> 400.0" in table and "410.0" in table
    s_text = summarize([RoundResult(1, 0, 0.0, 3.0, [_rec(9, 0.0, 0.1, 0.2, [], 0.5)])])
    assert format_first_audio({"summaries": {"1": s_text}}) == ""


def test_max_inter_token_gap_per_request_and_in_the_table():
    from bench.report import format_table

    a = _rec(0, 0.0, 0.1, 0.2, [(0.4, 1.0)], 0.5)
    a.text_events = [0.1, 0.15, 0.4, 0.45]  # gaps .05, .25, .05: held up once
    b = _rec(1, 1.0, 0.1, 0.2, [(0.4, 1.0)], 0.5)
    b.text_events = [1.1, 1.2, 1.3]
    one = _rec(2, 2.0, 0.1, 0.2, [(0.4, 1.0)], 0.5)  # a single text event: no gap
    assert a.max_itl == pytest.approx(0.25) and b.max_itl == pytest.approx(0.1)
    assert one.max_itl is None and a.timeline(0.0)["max_itl"] == pytest.approx(0.25)
    s = summarize([RoundResult(3, 0, 0.0, 3.0, [a, b, one])], percentiles=(50, 90))
    assert s["max_itl_ms"]["max"] == pytest.approx(250.0)
    assert s["max_itl_ms"]["median"] == pytest.approx(175.0)  # two requests with gaps
    table = format_table({"label": "t", "summaries": {"3": s}})
    header, _, row = table.splitlines()[1:4]
    assert "max ITL ms" in header and "175.0 (" in row


# ----------------------------------------------------------------------------- fake server


def test_metrics_match_scripted_server():
    script = FakeScript()  # text at .10/.12, audio 1.0+1.0+0.28 s at .20/.30/.35, end .36
    with FakeServerThread(script) as srv:
        res = _run(srv.url, BenchConfig(concurrencies=(1,), num_prompts=4, num_rounds=1,
                                        num_warmups=1, progress=False))
        body = srv.bodies[-1]
    assert len(res[1]["rounds"]) == 1 and res[1]["warmup"].records[0].warmup
    recs = res[1]["rounds"][0].records
    assert len(recs) == 4 and all(r.ok for r in recs), [r.error for r in recs]
    _bounded([r.ttft for r in recs], 0.10, "TTFT (first text event)")
    _bounded([r.ttfp for r in recs], 0.20, "TTFP (first audio event)")
    _bounded([r.audio_latency for r in recs], 0.35, "last audio event")
    _bounded([r.e2e for r in recs], 0.36, "E2E")
    _bounded([r.rtf for r in recs], 0.35 / 2.28, "RTF", tol=TOL_S / 2.28)
    for r in recs:
        assert r.audio_seconds == pytest.approx(2.28, abs=1e-6)
        assert [round(e.seconds, 6) for e in r.audio_events] == [1.0, 1.0, 0.28]
        # RTF is (last audio event - send) / audio seconds, queueing included
        assert r.rtf == pytest.approx((r.audio_events[-1].t - r.t_send) / 2.28, rel=1e-12)
        assert r.text == "B." and len(r.text_events) == 2
        assert r.max_itl == pytest.approx(r.text_events[1] - r.text_events[0])
        assert r.usage["completion_tokens"] == 8
        assert r.timings is not None and r.stage_durations()["code2wav"] > 0
    s = summarize(res[1]["rounds"])
    rnd = res[1]["rounds"][0]
    # c=1: four requests of >= 0.36 s each, back to back
    assert rnd.duration >= 4 * 0.36 - EPS_S
    assert s["request_throughput"] == pytest.approx(4 / rnd.duration)
    assert 0.6 / 0.36 < s["request_throughput"] <= 1 / 0.36 + 1e-6, s["request_throughput"]
    assert s["audio_throughput"] == pytest.approx(2.28 * s["request_throughput"])
    assert s["audio_duration_s"]["median"] == pytest.approx(2.28)
    assert body["omniray"]["return_timings"] is True and body["stream"] is True


def test_queueing_counts_in_ttft_and_rtf():
    # the server runs one request at a time; the client keeps two in flight
    with FakeServerThread(FakeScript(capacity=1)) as srv:
        res = _run(srv.url, BenchConfig(concurrencies=(2,), num_prompts=4, num_rounds=1,
                                        num_warmups=0, progress=False))
    rnd = res[2]["rounds"][0]
    recs = sorted(rnd.records, key=lambda r: r.ttft)
    assert len(recs) == 4 and all(r.ok for r in recs)
    # the server reports how long each request waited for the slot ("queue" span); the client
    # measures from before the send, so its TTFT / TTFP / RTF include that wait entirely
    queue = [r.stage_durations()["queue"] for r in recs]
    assert queue[0] < 0.1, "the first request is served at once"
    assert min(queue[1:]) > 0.2, f"the others wait for a whole request (~0.36 s): {queue}"
    for r, q in zip(recs, queue):
        assert r.ttft >= q + 0.10 - EPS_S, (r.ttft, q)
        assert r.ttfp >= q + 0.20 - EPS_S, (r.ttfp, q)
        assert r.rtf >= (q + 0.35) / 2.28 - EPS_S, (r.rtf, q)
    _bounded([r.ttft - q for r, q in zip(recs, queue)], 0.10, "TTFT minus server queue")
    _bounded([r.rtf - q / 2.28 for r, q in zip(recs, queue)], 0.35 / 2.28,
             "RTF minus queue / audio seconds", tol=TOL_S / 2.28)
    assert rnd.duration >= 4 * 0.36 - EPS_S, "capacity 1 serializes the four requests"
    s = summarize([rnd])
    assert s["request_throughput"] <= 1 / 0.36 + 1e-6
    assert s["audio_rtf"]["max"] > (0.2 + 0.35) / 2.28


def test_fixed_length_mode_audio_duration():
    with FakeServerThread(FakeScript()) as srv:
        res = _run(srv.url, BenchConfig(concurrencies=(1,), num_prompts=1, num_rounds=1,
                                        num_warmups=0, progress=False),
                   fixed_text_tokens=16, fixed_speech_codes=57)
        body = srv.bodies[-1]
    r = res[1]["rounds"][0].records[0]
    assert r.ok, r.error
    assert body["omniray"]["fixed_speech_codes"] == 57 and body["omniray"]["ignore_eos"] is True
    assert [e.seconds for e in r.audio_events] == pytest.approx([1.0, 1.0, 0.28])
    assert r.audio_seconds == pytest.approx(2.28)
    assert r.usage["completion_tokens"] == 16


def test_connection_failure_is_recorded_not_raised():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(f"http://127.0.0.1:{port}", BenchConfig(concurrencies=(1,), num_prompts=2,
                                                       num_rounds=1, num_warmups=0,
                                                       progress=False))
    recs = res[1]["rounds"][0].records
    assert len(recs) == 2 and not any(r.ok for r in recs)
    assert all("Connect" in (r.error or "") for r in recs), [r.error for r in recs]
    s = summarize(res[1]["rounds"])
    assert s["failed"] == 2 and s["completed"] == 0 and s["request_throughput"] == 0.0
