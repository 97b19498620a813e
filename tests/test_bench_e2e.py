"""End to end: `python -m bench run` on a tiny synthetic set against the fake server (127.0.0.1),
writing run.json + PNGs; baseline ratios; knob attribution through both launchers."""

from __future__ import annotations

import json
import re
import socket
import sys

import pytest
import yaml

from bench.attribution import (
    ServeRunLauncher,
    UrlLauncher,
    apply_overrides,
    collect,
    format_attribution,
    parse_knob,
    parse_sets,
    run_attribution,
)
from bench.cli import main as cli_main
from bench.client import BenchConfig, ClientOptions, RequestSpec
from bench.fake_server import FakeScript, FakeServerThread
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


def test_apply_overrides_places_knobs():
    cfg = {"applications": [{"name": "omni", "import_path": "deployments.app:build",
                             "args": {"thinker": {"compile_mm_encoder": True},
                                      "code2wav": {"batch_wait_ms": 5}}}]}
    new, where = apply_overrides(cfg, parse_knob("compile_mm_encoder=false").overrides)
    assert new["applications"][0]["args"]["thinker"]["compile_mm_encoder"] is False
    assert cfg["applications"][0]["args"]["thinker"]["compile_mm_encoder"] is True, "copy"
    assert where == ["applications.0.args.thinker.compile_mm_encoder"]
    new, where = apply_overrides(cfg, parse_knob("active_stream_window=2").overrides)
    assert new["applications"][0]["args"]["active_stream_window"] == 2
    new, _ = apply_overrides(
        cfg, parse_knob("applications.0.args.code2wav.batch_wait_ms=0,"
                        "vision_attn_backend=sdpa").overrides)
    assert new["applications"][0]["args"]["code2wav"]["batch_wait_ms"] == 0
    assert new["applications"][0]["args"]["vision_attn_backend"] == "sdpa"


def _specs() -> list[RequestSpec]:
    return [RequestSpec("x", [{"role": "user", "content": "hi"}])]


def test_attribution_with_running_servers(tmp_path):
    cfg = BenchConfig(concurrencies=(1,), num_prompts=3, num_rounds=1, num_warmups=0,
                      progress=False)
    knob = parse_knob("compile_mm_encoder=false")
    broken = parse_knob("vision_attn_backend=nope")
    with FakeServerThread(FakeScript()) as a, \
            FakeServerThread(FakeScript(time_scale=2.0)) as b:
        dead = f"http://127.0.0.1:{_free_port()}"
        launcher = UrlLauncher(a.url, {knob.label: b.url, broken.label: dead},
                               ready_timeout_s=1.5)
        res = run_attribution([broken, knob], launcher, _specs(), ClientOptions(retries=0), cfg,
                              out_dir=tmp_path / "attr")
    assert list(res.errors) == ["vision_attn_backend=nope"], res.errors
    assert "not ready" in res.errors[broken.label]
    (row,) = res.deltas()
    assert row["knob"] == "compile_mm_encoder=false" and row["concurrency"] == 1
    # B takes twice as long: +100 % latency, -50 % throughput (loose: shared machine)
    for k in ("e2el_ms", "audio_rtf"):
        assert 0.6 < row["delta"][k] < 1.4, (k, row["delta"])
    for k in ("ttft_ms", "audio_ttfp_ms"):
        assert 0.3 < row["delta"][k] < 1.6, (k, row["delta"])
    assert -0.65 < row["delta"]["request_throughput"] < -0.3, row["delta"]
    table = format_attribution(res)
    assert re.search(r"compile_mm_encoder=false\s+1\s+-\d\d\.\d%!", table), table
    assert "vision_attn_backend=nope: no result" in table
    # the saved runs rebuild the same deltas (e.g. from several split invocations)
    again = collect([tmp_path / "attr"])
    assert again.deltas() == res.deltas()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attribution_launches_and_stops_a_server_per_config(tmp_path):
    """ServeRunLauncher with the fake server as the 'serve run' command: the knob (time_scale)
    reaches the server through the YAML copy; the server is stopped after each config."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve_yaml = tmp_path / "serve_config.yaml"
    serve_yaml.write_text(yaml.safe_dump({"applications": [
        {"name": "omni", "import_path": "x:y", "args": {"engine": {"time_scale": 1.0}}}]}))
    launch = f"{sys.executable} -m bench.fake_server --port {port} --config {{config}}"
    launcher = ServeRunLauncher(serve_yaml, url, launch_cmd=launch, log_dir=tmp_path / "logs",
                                ready_timeout_s=60, stop_timeout_s=20)
    # one warmup: the first request to a fresh process pays its start-up
    cfg = BenchConfig(concurrencies=(1,), num_prompts=2, num_rounds=1, num_warmups=1,
                      progress=False)
    knob = parse_knob("time_scale=2")
    crash = parse_knob("time_scale=oops")  # the server exits at start-up: reported, skipped
    res = run_attribution([crash, knob], launcher, _specs(), ClientOptions(retries=0), cfg,
                          out_dir=tmp_path / "attr")
    assert "exited" in res.errors["time_scale=oops"], res.errors
    (row,) = res.deltas()
    # everything takes twice as long (loose bands: shared machine)
    for k in ("e2el_ms", "audio_rtf"):
        assert 0.6 < row["delta"][k] < 1.4, (k, row["delta"])
    assert 0.3 < row["delta"]["ttft_ms"] < 1.6, row["delta"]
    assert launcher.placements[knob.label] == ["applications.0.args.engine.time_scale"]
    # servers are gone, temp configs removed, results and logs written
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "server still listening"
    assert not list(tmp_path.glob(".attr-*.yaml"))
    saved = json.loads((tmp_path / "attr" / "attribution.json").read_text())
    assert saved["deltas"][0]["knob"] == "time_scale=2"
    assert (tmp_path / "attr" / "base" / "run.json").exists()
    assert (tmp_path / "logs" / "base.log").exists()
    assert "time_scale=2" in (tmp_path / "attr" / "attribution.txt").read_text()


def test_targets_table():
    from bench.report import ISSUE5_TARGETS, check_targets, format_targets

    def summ(rps, aps, ttft, ttfp, rtf):
        return {"request_throughput": rps, "audio_throughput": aps, "ttft_ms": {"median": ttft},
                "audio_ttfp_ms": {"median": ttfp}, "audio_rtf": {"median": rtf},
                "e2el_ms": {"median": 1.0}}

    run = {"summaries": {"1": summ(3.5, 8.0, 150.0, 260.0, 0.12),
                         "4": summ(4.0, 12.0, 300.0, 400.0, 0.3)}}
    rows = {(r["concurrency"], r["metric"]): r for r in check_targets(run, ISSUE5_TARGETS)}
    assert rows[(1, "ttft_ms")]["met"] and rows[(1, "request_throughput")]["met"]
    assert not rows[(1, "audio_ttfp_ms")]["met"]
    assert rows[(1, "audio_ttfp_ms")]["gap"] == pytest.approx(260 / 250 - 1)
    assert not rows[(4, "request_throughput")]["met"] and rows[(4, "audio_throughput")]["met"]
    text = format_targets(run)
    assert text.count("MISS") == 2 and text.count(" ok ") + text.count(" ok\n") >= 4, text


def test_gpu_e2e_app_args(tmp_path):
    """The per-phase app args of bench.gpu_e2e: model, knob overrides and the media folder."""
    from bench.gpu_e2e import app_args

    over = parse_knob("token2wav_cfm_cuda_graph=false,active_stream_window=1").overrides
    args = app_args("serve_config.yaml", "random-full", over, media_dir=str(tmp_path))
    assert args["model"] == "random-full" and args["active_stream_window"] == 1
    assert args["code2wav"]["engine"]["token2wav_cfm_cuda_graph"] is False
    # --set as bench.gpu_e2e and bench.realtime take it: repeated, each one or more pairs
    sets = app_args("serve_config.yaml", None, parse_sets(
        ["piecewise_graph_tokens=0", "active_stream_window=2,groups=1"]))
    assert sets["thinker"]["engine"]["llm"]["piecewise_graph_tokens"] == 0
    assert sets["active_stream_window"] == 2 and sets["groups"] == 1
    assert parse_sets([]) == ()
    assert args["allowed_local_media_path"] == str(tmp_path.resolve())
    base = app_args("bench/baseline_config.yaml", None)
    assert base["model"] is None and base["allowed_local_media_path"] is None
    assert base["thinker"]["engine"]["llm"]["cuda_graphs"] is False


def test_baseline_config_runs_the_plain_paths():
    """The baseline stays the plain pipeline while the app's defaults move: the Code2Wav
    fast-path knobs (the app's defaults) and the Thinker's caches and graphs are off in it."""
    import dataclasses
    from pathlib import Path

    import yaml

    from deployments.app import engine_configs
    from deployments.config import AppConfig
    from pipeline.code2wav.engine import Code2WavEngineConfig

    root = Path(__file__).parents[1]
    args = yaml.safe_load((root / "bench/baseline_config.yaml").read_text())
    cfg = engine_configs(AppConfig.model_validate(args["applications"][0]["args"]))
    plain = Code2WavEngineConfig()
    fast = AppConfig().code2wav.engine
    assert fast and all(v is True for v in fast.values())
    for knob in fast:
        assert getattr(cfg["code2wav"], knob) is False is getattr(plain, knob), knob
    llm = cfg["thinker"].llm
    assert not (llm.cuda_graphs or llm.enable_prefix_caching or llm.device_sampling)
    assert dataclasses.is_dataclass(llm)


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


def test_start_note_says_each_gpu_stage_wait_and_build():
    """Beside RUNNING, each GPU stage's start from its stats (`gpu_sharing.start_s`): what
    `stage_start` changes; CPU stages report none."""
    from bench.gpu_e2e import start_note

    stats = {"Thinker": {"gpu_sharing": {"start_s": {"waited": 0.0, "built": 61.2}}},
             "Talker": {"gpu_sharing": {"start_s": {"waited": 61.3, "built": 14.0}}},
             "Code2Wav": {"gpu_sharing": None}}
    assert start_note(stats) == ("stage starts: Thinker waited 0.0 s, built in 61.2 s; "
                                 "Talker waited 61.3 s, built in 14.0 s")
    assert start_note({"Thinker": {"gpu_sharing": None}}) == "stage starts: not reported (CPU)"
