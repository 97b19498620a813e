"""End to end: `python -m bench run` on a tiny synthetic set against the fake server (127.0.0.1),
writing run.json + PNGs; baseline ratios; and bench.gpu_e2e's parts that need no GPU."""

from __future__ import annotations

import re

import pytest

from bench.cli import main as cli_main
from tests.fake_server import FakeScript, FakeServerThread
from bench.report import format_report, load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_DATA = ["--dataset", "synthetic", "--synthetic-durations", "2", "--synthetic-size", "32x32",
             "--synthetic-fps", "2"]


def test_synthetic_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    with FakeServerThread(FakeScript()) as srv:
        rc = cli_main(["run", "--url", srv.url, *TINY_DATA, "--data-dir", str(tmp_path / "data"),
                       "--concurrency", "1,2", "--num-prompts", "3", "--rounds", "2",
                       "--warmups", "1", "--fixed-text-tokens", "8", "--fixed-speech-codes", "57",
                       "--out", str(out), "--label", "tiny", "--no-progress"])
        bodies = list(srv.bodies)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny: medians" in printed and "per-stage median ms" in printed
    # 2 concurrencies x (1 warmup + 2 rounds x 3) requests, each with video + audio parts
    assert len(bodies) == 14
    parts = bodies[0]["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["video_url", "input_audio", "text"]
    assert bodies[0]["omniray"]["fixed_speech_codes"] == 57

    run = load_run(out / "run.json")
    assert set(run["summaries"]) == {"1", "2"}
    for c in ("1", "2"):
        s = run["summaries"][c]
        assert s["completed"] == 6 and s["failed"] == 0 and s["num_rounds"] == 2
        assert len(s["per_round"]) == 2
        assert s["audio_duration_s"]["median"] == pytest.approx(2.28)
        assert 100.0 - 2 <= s["ttft_ms"]["min"] <= s["ttft_ms"]["median"] < 300, s["ttft_ms"]
        assert s["accuracy"] is not None and s["graded"] == 6
        assert set(s["stages_ms"]) >= {"queue", "prefill", "talker", "code2wav"}
    rounds = run["rounds"]
    assert [(r["concurrency"], r["warmup"]) for r in rounds] == [
        (1, True), (1, False), (1, False), (2, True), (2, False), (2, False)]
    req = rounds[1]["requests"][0]
    assert req["ok"] and req["t_send"] >= 0
    assert req["t_send"] < req["t_first_text"] < req["t_first_audio"] <= req["t_end"]
    assert [round(sec, 6) for _, sec in req["audio_events"]] == [1.0, 1.0, 0.28]
    assert req["timings"]["spans"][0]["stage"] == "queue"
    assert req["meta"]["duration"] == "2s" and req["answer"] in "ABCD"
    # warmup requests are in the file but flagged and not counted
    assert all(r["warmup"] for r in rounds[0]["requests"])

    for name in ("latency_distributions.png", "stage_timeline.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    assert (out / "report.txt").read_text().startswith("tiny: medians")


def test_baseline_ratios(tmp_path, capsys):
    """--baseline-url runs the (3x slower) baseline first; ratio rows show this / baseline."""
    out = tmp_path / "out"
    with FakeServerThread(FakeScript()) as fast, \
            FakeServerThread(FakeScript(time_scale=3.0)) as slow:
        rc = cli_main(["run", "--url", fast.url, "--baseline-url", slow.url, *TINY_DATA,
                       "--data-dir", str(tmp_path / "data"), "--concurrency", "1,2",
                       "--num-prompts", "3", "--rounds", "1", "--warmups", "0",
                       "--out", str(out), "--no-plots", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    base = load_run(out / "baseline" / "run.json")
    assert set(base["summaries"]) == {"1"}, "the baseline runs at --baseline-concurrency only"
    # c=1 and c=2 both compare against the baseline's c=1; latencies are about a third.
    # headline table: one ratio row per concurrency; then the stage table's ratio rows
    ratio_rows = [ln.split() for ln in printed.splitlines() if ln.strip().startswith("/b1")]
    assert len(ratio_rows) == 4, printed
    head = ratio_rows[0]  # c=1: /b1 req/s audio-s/s TTFT TTFP RTF E2E ...
    vals = [float(x[1:]) for x in head[1:7]]
    req_ratio, audio_ratio, ttft_ratio, ttfp_ratio, rtf_ratio, e2e_ratio = vals
    # loose bands: the machine running the tests is shared and delays only add
    assert 2.0 < req_ratio < 3.4 and 2.0 < audio_ratio < 3.4, head
    for r in (rtf_ratio, e2e_ratio):
        assert 0.28 < r < 0.5, head
    for r in (ttft_ratio, ttfp_ratio):
        assert 0.25 < r < 0.7, head
    # the saved pair gives the same table through `report`
    run = load_run(out / "run.json")
    text = format_report(run, base)
    assert re.search(r"/b1\s+x\d", text)
    rc = cli_main(["report", str(out / "run.json"), "--baseline",
                   str(out / "baseline" / "run.json"), "--plots", str(tmp_path / "plots")])
    assert rc == 0 and (tmp_path / "plots" / "throughput.png").exists()


def test_apply_overrides_places_keys():
    """--set as bench.gpu_e2e and bench.realtime take it: a bare key replaced wherever it
    occurs (or added to every application's args), a dotted path set as written."""
    from bench.gpu_e2e import apply_overrides, parse_sets

    cfg = {"applications": [{"name": "omni", "import_path": "deployments.app:build_app",
                             "args": {"thinker": {"engine": {"kv_cache_gib": 16}},
                                      "code2wav": {"engine": {"kv_cache_gib": 2}}}}]}
    new = apply_overrides(cfg, parse_sets(["kv_cache_gib=4"]))
    args = new["applications"][0]["args"]
    assert args["thinker"]["engine"]["kv_cache_gib"] == 4 == args["code2wav"]["engine"]["kv_cache_gib"]
    assert cfg["applications"][0]["args"]["thinker"]["engine"]["kv_cache_gib"] == 16, "a copy"
    new = apply_overrides(cfg, parse_sets(["capacity=2", "applications.0.args.talker_mode=x,"
                                           "applications.0.args.thinker.engine.kv_cache_gib=8"]))
    args = new["applications"][0]["args"]
    assert args["capacity"] == 2 and args["talker_mode"] == "x"
    assert args["thinker"]["engine"]["kv_cache_gib"] == 8
    assert args["code2wav"]["engine"]["kv_cache_gib"] == 2
    assert parse_sets([]) == ()
    assert parse_sets(["a=false,b=1.5", "c=sdpa"]) == (("a", False), ("b", 1.5), ("c", "sdpa"))
    with pytest.raises(ValueError):
        parse_sets(["a"])


def test_targets_table():
    from bench.report import APP_TARGETS, check_targets, format_targets

    def summ(rps, aps, ttft, ttfp, rtf):
        return {"request_throughput": rps, "audio_throughput": aps, "ttft_ms": {"median": ttft},
                "audio_ttfp_ms": {"median": ttfp}, "audio_rtf": {"median": rtf},
                "e2el_ms": {"median": 1.0}}

    run = {"summaries": {"1": summ(3.5, 8.0, 150.0, 260.0, 0.12),
                         "4": summ(4.0, 12.0, 300.0, 400.0, 0.3)}}
    rows = {(r["concurrency"], r["metric"]): r for r in check_targets(run, APP_TARGETS)}
    assert rows[(1, "ttft_ms")]["met"] and rows[(1, "request_throughput")]["met"]
    assert not rows[(1, "audio_ttfp_ms")]["met"]
    assert rows[(1, "audio_ttfp_ms")]["gap"] == pytest.approx(260 / 250 - 1)
    assert not rows[(4, "request_throughput")]["met"] and rows[(4, "audio_throughput")]["met"]
    text = format_targets(run)
    assert text.count("MISS") == 2 and text.count(" ok ") + text.count(" ok\n") >= 4, text


def test_gpu_e2e_app_args(tmp_path):
    """The app's args of bench.gpu_e2e: model, --set overrides and the media folder."""
    from bench.gpu_e2e import app_args, parse_sets, stage_names

    args = app_args("serve_config.yaml", "random-full", parse_sets(["groups=1,request_timeout_s=9"]),
                    media_dir=str(tmp_path))
    assert args["model"] == "random-full" and args["groups"] == 1
    assert args["request_timeout_s"] == 9
    assert args["allowed_local_media_path"] == str(tmp_path.resolve())
    plain = app_args("serve_config.yaml", None)
    assert plain["allowed_local_media_path"] != str(tmp_path.resolve())
    assert stage_names("Code2Wav", 1) == ["Code2Wav"]
    assert stage_names("Talker", 2) == ["Talker-g0", "Talker-g1"]


def test_first_turn_reports_the_first_request_sent():
    from bench.gpu_e2e import first_turn

    def rec(t_send, ttft, ok=True, spans=None):
        return {"t_send": t_send, "ttft": ttft, "ok": ok, "warmup": True,
                "stage_durations": spans or {}}

    run = {"rounds": [{"requests": [rec(0.2, 0.31, spans={"prefill": 0.06, "vision_encoder": 0.08}),
                                    rec(0.0, 105.9, spans={"prefill": 0.5, "queue": 0.01}),
                                    rec(0.1, 0.0, ok=False),
                                    rec(0.3, 0.29, spans={"prefill": 0.07})]},
                      {"requests": [rec(-1.0, 0.05)]}]}  # a later round: not the first turn
    assert first_turn(run) == (
        "first turn after RUNNING: TTFT 105900 ms (the round's others: median 310 ms); "
        "spans ms, it / the others' median: prefill 500 / 70")  # no others' queue: left out
    assert "no request" in first_turn({"rounds": []})


def test_stage_shares_report_code2wav_busy_and_talker_and_thinker_times(capsys):
    """bench.gpu_e2e.StageShares over one concurrency's rounds, against a stand-in app: the
    deltas of the engines' counters between the rounds' start and end."""
    from types import SimpleNamespace

    from bench.gpu_e2e import StageShares

    stats = {"Code2Wav": {"busy_ms": 100.0, "batch_size_1": 3, "chunks": 3},
             "Talker": {"prefills": 2, "prefill_ms": 20.0, "steps": 50, "decode_ms": 60.0,
                        "codes": 50},
             "Thinker": {"decode_gpu_steps": 10, "decode_gpu_ms": 60.0, "decode_idle_gaps": 8,
                         "decode_idle_ms": 16.0}}
    turns = [4]

    def handle(name, app_name):
        return SimpleNamespace(stats=SimpleNamespace(remote=lambda: SimpleNamespace(
            result=lambda: {"engine": dict(stats[name])})))

    srv = SimpleNamespace(stage_names=lambda stage: [stage],
                          serve=SimpleNamespace(get_deployment_handle=handle),
                          ingress_stats=lambda: {"groups": [{"turns": turns[0]}]})
    shares = StageShares(srv)
    shares(1, "start")
    stats["Code2Wav"] = {"busy_ms": 400.0, "batch_size_1": 9, "chunks": 9}
    stats["Talker"] = {"prefills": 6, "prefill_ms": 60.0, "steps": 170, "decode_ms": 204.0,
                       "codes": 170}
    stats["Thinker"] = {"decode_gpu_steps": 110, "decode_gpu_ms": 660.0, "decode_idle_gaps": 98,
                        "decode_idle_ms": 196.0}
    turns[0] = 6
    shares(1, "end")
    row = shares.rows[1]
    assert row["chunks"] == 6 and row["batches"] == {1: 6} and row["turns"] == 2
    assert row["busy_share"] > 0  # 300 busy ms over the stand-in rounds' wall clock
    talker = row["talker"]
    assert talker["ms_a_prefill"] == 10.0 and talker["ms_a_step"] == 1.2
    assert talker["prefills"] == 4 and talker["steps"] == 120 and talker["codes"] == 120
    thinker = row["thinker"]
    assert thinker["gpu_ms_a_step"] == 6.0 and thinker["idle_ms_a_gap"] == 2.0
    out = capsys.readouterr().out
    assert "10.0 ms a unit start" in out
    assert "Thinker at c=1: 6.0 ms of GPU a decode step, 2.0 ms idle" in out


def test_attention_note_warns_when_a_gpu_thinker_runs_the_torch_backend():
    """An app run on a GPU whose image lacks flashinfer still serves, several times slower:
    the bench says so beside RUNNING, from the Thinker deployment's stats."""
    from bench.gpu_e2e import attention_note

    gpu = {"gpu_allocated_gib": 34.4}
    assert attention_note({"engine": {"flashinfer_attention": 1}, **gpu}) == (
        "Thinker attention backend: flashinfer")
    assert attention_note({"engine": {"flashinfer_attention": 0}, **gpu}).startswith("WARNING")
    assert attention_note({"engine": {"flashinfer_attention": 0}}) == (
        "Thinker attention backend: torch")  # on CPU: the only one
    assert attention_note({}) == "Thinker attention backend: unknown"
