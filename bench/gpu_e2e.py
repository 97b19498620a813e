"""Issue 5's whole measurement in one process: the app, its baseline and the knob attribution,
each started in-process on one Ray instance (no `serve run` per variant, no Ray restarts).

    python -m bench.gpu_e2e --phases main,baseline,attribution --checkpoint random-full \\
        --data-dir /tmp/syn --synthetic-durations 30 --media file \\
        --fixed-text-tokens 16 --fixed-speech-codes 57 \\
        --concurrency 1,4 --num-prompts 20 --rounds 3 --warmups 4 \\
        --baseline-num-prompts 10 --baseline-rounds 1 \\
        --knob compile_mm_encoder=false --knob token2wav_cfm_cuda_graph=false \\
        --attr-concurrency 4 --attr-num-prompts 12 --out results/h200

Phases (each one app at a time; the app is deleted before the next starts, so they never share
the GPU):
  main         `--config` (serve_config.yaml) with `model` set: c in --concurrency, the run's
               JSON, report and plots under <out>/main (ratios against <out>/baseline if there);
               then, on the same app, the questions alone (no media, speech still asked for)
               at --text-concurrency, under <out>/text
  baseline     `--baseline-config` (bench/baseline_config.yaml) at --baseline-concurrency
  attribution  A = `--config`, then one B per --knob (bench.attribution's override syntax),
               each at --attr-concurrency; table under <out>/attribution
After each app run, every stage's `stats` (memory, engine counters such as graph replays and
fallbacks) is written next to its run.json as stats.json. Exits 1 if a request failed.
Per concurrency, the Code2Wav busy share (per group with `--groups N`, with its turns) and the
Talker's wall ms a prefill and a decode call (its engine's counters over the measured rounds),
printed and written as stages.json.
`--profile-first-turn STAGE:N[,STAGE:N...]` (main phase) profiles each stage's first N engine
steps after the app reports RUNNING, where they run (deployments/profiling.py: per step its
wall and device ms, top kernels and host ops), into <out>/main/profile_<stage>.txt: the first
turn's steps and, with N large enough, the next turns' to compare them with.
Needs Ray Serve importable (on the GPU machine: `source .gpu/ray/device-env.sh`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from bench.attribution import (
    CallbackLauncher,
    Variant,
    apply_overrides,
    collect,
    format_attribution,
    parse_knob,
    parse_sets,
    run_attribution,
)
from bench.cli import (
    _ints,
    add_client_args,
    add_data_args,
    bench_config,
    client_options,
    execute,
    load_specs,
    write_outputs,
)
from bench.report import load_run

STAGES = ("Thinker", "Talker", "Code2Wav")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(config_path: str, model: str | None, overrides=(), media_dir: str | None = None
             ) -> dict[str, Any]:
    """The app's `args` from a Serve YAML, with `model` and the overrides applied; `media_dir`
    is where file:// media may be read from (`--media file`, as vLLM-Omni's bench sends them)."""
    with open(config_path) as f:
        tree = yaml.safe_load(f)
    tree, _ = apply_overrides(tree, overrides)
    args = tree["applications"][0]["args"]
    if model is not None:
        args["model"] = model
    if media_dir is not None:
        args["allowed_local_media_path"] = str(Path(media_dir).resolve())
    return args


class InProcessServe:
    """One Ray instance and HTTP proxy; `app(args)` runs one omniray app until the block ends."""

    def __init__(self) -> None:
        for k, v in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_USAGE_STATS_ENABLED", "0"),
                     ("RAY_AUTH_MODE", "disabled")):
            os.environ.setdefault(k, v)
        import ray
        from ray import serve

        self.ray, self.serve = ray, serve
        ray.init(include_dashboard=False, log_to_driver=False)
        self.port = _port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"
        self.groups = 1

    @contextlib.contextmanager
    def app(self, args: dict[str, Any], label: str, stats_out: Path | None = None
            ) -> Iterator[str]:
        from deployments.app import build_omni_app
        from deployments.config import AppConfig

        t = time.perf_counter()
        self.serve.run(build_omni_app(args), name="omniray", route_prefix="/")
        self.groups = len(self.ingress_stats().get("groups", [None]))
        # What moves the serving path's milliseconds: the stage hops' transport, and the
        # Serve settings this process's Ray was started with (e.g. RAY_SERVE_PROXY_USE_GRPC).
        serve_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
        print(f"[{label}] app RUNNING after {time.perf_counter() - t:.1f} s "
              f"({self.groups} group(s); stage_transport "
              f"{AppConfig.model_validate(args).stage_transport}; Serve environment "
              f"{serve_env or 'default'})", flush=True)
        try:
            stats = {s: self.first(s).stats.remote().result() for s in STAGES}
            print(f"[{label}] {attention_note(stats['Thinker'])}", flush=True)
            print(f"[{label}] {start_note(stats)}", flush=True)
            yield self.url
            if stats_out is not None:
                stats_out.mkdir(parents=True, exist_ok=True)
                (stats_out / "stats.json").write_text(json.dumps(self.stats(), indent=1,
                                                                 default=str))
        finally:
            t = time.perf_counter()
            self.serve.delete("omniray")
            print(f"[{label}] app deleted in {time.perf_counter() - t:.1f} s", flush=True)

    def stage_names(self, stage: str) -> list[str]:
        """One deployment name per group of a stage (e.g. Code2Wav, or Code2Wav-g0, ...)."""
        from deployments.app import stage_names

        return [stage_names(g, self.groups)[stage.lower()] for g in range(self.groups)]

    def profile(self, stage: str, steps: int, timeout_s: float) -> Any:
        """Arm a profile of the first group's `stage` (its next `steps` steps); returns the
        pending response (`.result()`: {"stage", "steps"})."""
        return self.first(stage).profile.remote(steps, timeout_s)

    def first(self, stage: str) -> Any:
        """The handle of the first group's deployment of `stage`."""
        return self.serve.get_deployment_handle(self.stage_names(stage)[0], app_name="omniray")

    def ingress_stats(self) -> dict[str, Any]:
        return self.serve.get_app_handle("omniray").stats.remote().result()

    def stats(self) -> dict[str, Any]:
        out = {}
        for stage in STAGES:
            for name in self.stage_names(stage):
                h = self.serve.get_deployment_handle(name, app_name="omniray")
                out[name] = h.stats.remote().result()
        out["ingress"] = self.ingress_stats()
        return out

    def close(self) -> None:
        self.serve.shutdown()
        self.ray.shutdown()


class StageShares:
    """Per concurrency, over its measured rounds: each group's Code2Wav busy share of the wall
    clock (its engine's `busy_ms`: decode time with the PCM on the host), batch-size
    histogram, and the turns the ingress sent to the group; the first group's Talker:
    wall ms a unit start (prefill + first draw) and a decode call (replay + codes read);
    and its Thinker's pure-decode steps: GPU ms a step (other stages' kernels time-sliced
    in count) and the GPU's idle ms before a step launched behind another (the host late)."""

    def __init__(self, srv: InProcessServe):
        self.srv, self.rows, self._start = srv, {}, None

    def _snapshot(
        self,
    ) -> tuple[float, list[dict[str, float]], list[int], dict[str, float], dict[str, float]]:
        # called on the load generator's event loop, where a handle's blocking `result()` is
        # refused: ask from a worker thread (the loop waits; no request is in flight then)
        def engine_stats(name: str) -> dict[str, float]:
            h = self.srv.serve.get_deployment_handle(name, app_name="omniray")
            return h.stats.remote().result().get("engine", {})

        def ask():
            engines = [engine_stats(name) for name in self.srv.stage_names("Code2Wav")]
            groups = self.srv.ingress_stats().get("groups", [])
            talker = engine_stats(self.srv.stage_names("Talker")[0])
            thinker = engine_stats(self.srv.stage_names("Thinker")[0])
            return engines, [g["turns"] for g in groups] or [0], talker, thinker

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            engines, turns, talker, thinker = pool.submit(ask).result()
        return time.perf_counter(), engines, turns, talker, thinker

    def __call__(self, c: int, phase: str) -> None:
        if phase == "start":
            self._start = self._snapshot()
            return
        (t0, a_all, turns0, ta, ha), (t1, b_all, turns1, tb, hb) = self._start, self._snapshot()
        per_group = []
        for g, (a, b) in enumerate(zip(a_all, b_all)):
            delta = {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], int | float)}
            hist = {int(k[11:]): int(v) for k, v in delta.items()
                    if k.startswith("batch_size_") and v}
            busy = delta.get("busy_ms", 0.0) / 1e3 / (t1 - t0)
            per_group.append({"busy_share": round(busy, 3), "batches": dict(sorted(hist.items())),
                              "chunks": delta.get("chunks", 0),
                              "turns": turns1[g] - turns0[g] if g < len(turns1) else None})
            print(f"Code2Wav{f' g{g}' if len(a_all) > 1 else ''} at c={c}: busy {busy:.0%} of "
                  f"{t1 - t0:.1f} s; turns {per_group[-1]['turns']}; batches "
                  + " ".join(f"{k}:{v}" for k, v in sorted(hist.items())), flush=True)
        row = {"wall_s": round(t1 - t0, 2), **per_group[0]}
        if len(per_group) > 1:
            row = {"wall_s": round(t1 - t0, 2), "groups": per_group}
        talker = {k: tb.get(k, 0) - ta.get(k, 0) for k in
                  ("prefills", "prefill_ms", "steps", "decode_ms", "codes")}
        if talker["prefills"] and talker["steps"]:
            talker["ms_a_prefill"] = round(talker["prefill_ms"] / talker["prefills"], 2)
            talker["ms_a_step"] = round(talker["decode_ms"] / talker["steps"], 2)
            print(f"Talker at c={c}: {talker['ms_a_prefill']} ms a unit start (prefill + first "
                  f"draw; {talker['prefills']}), {talker['ms_a_step']} ms a decode step "
                  f"({talker['steps']} steps, {talker['codes']} codes)", flush=True)
        row["talker"] = talker
        thinker = {k: hb.get(k, 0) - ha.get(k, 0) for k in
                   ("decode_gpu_steps", "decode_gpu_ms", "decode_idle_gaps", "decode_idle_ms")}
        if thinker["decode_gpu_steps"]:
            thinker["gpu_ms_a_step"] = round(
                thinker["decode_gpu_ms"] / thinker["decode_gpu_steps"], 2)
            thinker["idle_ms_a_gap"] = round(
                thinker["decode_idle_ms"] / max(1, thinker["decode_idle_gaps"]), 2)
            print(f"Thinker at c={c}: {thinker['gpu_ms_a_step']} ms of GPU a decode step, "
                  f"{thinker['idle_ms_a_gap']} ms idle before one launched behind another "
                  f"({thinker['decode_gpu_steps']} steps, {thinker['decode_idle_gaps']} "
                  "behind)", flush=True)
        row["thinker"] = thinker
        self.rows[c] = row


def attention_note(thinker: dict[str, Any]) -> str:
    """The Thinker's paged attention backend, from its deployment's stats; a warning when a
    GPU replica runs the torch one (flashinfer not importable): its numbers are not the
    app's (no decode graphs: several times slower decode and prefill)."""
    flag = thinker.get("engine", {}).get("flashinfer_attention")
    backend = {1: "flashinfer", 0: "torch"}.get(flag, "unknown")
    if backend == "torch" and "gpu_allocated_gib" in thinker:
        return ("WARNING: the Thinker runs the torch attention backend on the GPU (flashinfer "
                "not importable there): decode and prefill several times slower than served")
    return f"Thinker attention backend: {backend}"


def start_note(stats: dict[str, dict[str, Any]]) -> str:
    """Each GPU stage's start, from its stats (`gpu_sharing.start_s`): the wait for the
    per-GPU start lock (the stages before it, under `stage_start: serial`) and its build."""
    parts = []
    for stage, s in stats.items():
        start = (s.get("gpu_sharing") or {}).get("start_s")
        if start:
            parts.append(f"{stage} waited {start['waited']} s, built in {start['built']} s")
    return "stage starts: " + ("; ".join(parts) if parts else "not reported (CPU)")


def _failed(run: dict[str, Any]) -> int:
    return sum(s["failed"] for s in run["summaries"].values())


def first_turn(run: dict[str, Any]) -> str:
    """The app's first request after it reported RUNNING (the first warm-up sent): what a
    user's first turn pays for whatever the stages build on first use, with its server
    spans beside the round's others' medians (which stage pays it)."""
    sent = [r for r in run["rounds"][0]["requests"] if r["ok"]] if run["rounds"] else []
    if not sent:
        return "first turn after RUNNING: no request completed"
    r = min(sent, key=lambda r: r["t_send"])  # the first round ran first; t_send is its clock
    others = [x for x in sent if x is not r]
    tail = ""
    if others:
        tail = f" (the round's others: median {1e3 * _median([x['ttft'] for x in others]):.0f} ms)"
    spans = []
    for stage, sec in (r.get("stage_durations") or {}).items():
        theirs = [x["stage_durations"][stage] for x in others
                  if stage in (x.get("stage_durations") or {})]
        if theirs:
            spans.append(f"{stage} {1e3 * sec:.0f} / {1e3 * _median(theirs):.0f}")
    if spans:
        tail += "; spans ms, it / the others' median: " + ", ".join(spans)
    return f"first turn after RUNNING: TTFT {1e3 * r['ttft']:.0f} ms{tail}"


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="main,baseline,attribution")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--baseline-config", default="bench/baseline_config.yaml")
    ap.add_argument("--checkpoint", default=None, help="overrides the configs' `model` (e.g. random-full)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override in --config (and its attribution A), attribution syntax")
    ap.add_argument("--baseline-concurrency", default="1")
    ap.add_argument("--baseline-num-prompts", type=int, default=None)
    ap.add_argument("--baseline-rounds", type=int, default=None)
    ap.add_argument("--text-concurrency", default="",
                    help="main phase: also run the questions alone (no media) at these c")
    ap.add_argument("--groups", default=None,
                    help="stage groups (N or auto; one GPU each); reports per-group load")
    ap.add_argument("--knob", action="append", default=[])
    ap.add_argument("--attr-concurrency", default="4")
    ap.add_argument("--attr-num-prompts", type=int, default=None)
    ap.add_argument("--attr-rounds", type=int, default=1)
    ap.add_argument("--attr-warmups", type=int, default=None)
    ap.add_argument("--attr-resume", default=None, metavar="DIR",
                    help="an earlier attribution folder: reuse its A, skip the Bs it has "
                         "(combine both with `python -m bench.attribution --collect`)")
    ap.add_argument("--profile-first-turn", default=None, metavar="STAGE:N[,STAGE:N...]",
                    help="profile each STAGE's (Thinker, Talker, Code2Wav) first N steps after "
                         "RUNNING")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-plots", action="store_true")
    add_client_args(ap, with_url=False)
    add_data_args(ap)
    args = ap.parse_args(argv)
    args.url = "http://127.0.0.1:0"  # replaced per app
    phases = [p for p in args.phases.split(",") if p]
    out = Path(args.out)
    sets = [*args.set, *([f"applications.0.args.groups={args.groups}"] if args.groups else [])]
    base_over = parse_sets(sets)
    media_dir = args.data_dir if args.media == "file" else None

    specs = load_specs(args)
    print(f"{len(specs)} request specs from {args.data_dir}", flush=True)
    srv = InProcessServe()
    failed = 0
    try:
        if "baseline" in phases:
            cfg = bench_config(args, _ints(args.baseline_concurrency))
            cfg = replace(cfg, num_prompts=args.baseline_num_prompts or cfg.num_prompts,
                          num_rounds=args.baseline_rounds or cfg.num_rounds)
            app = app_args(args.baseline_config, args.checkpoint, (), media_dir)
            with srv.app(app, "baseline", out / "baseline") as url:
                run = execute(specs, client_options(args, url), cfg, label="baseline",
                              config={"serve_config": args.baseline_config, **vars(args)})
            print(write_outputs(run, out / "baseline", None, plots=not args.no_plots), flush=True)
            failed += _failed(run)
        if "main" in phases:
            app = app_args(args.config, args.checkpoint, base_over, media_dir)
            with srv.app(app, "main", out / "main") as url:
                profiling = []
                for spec in filter(None, (args.profile_first_turn or "").split(",")):
                    stage, _, n = spec.strip().partition(":")
                    profiling.append((stage, srv.profile(stage, int(n or 40), timeout_s=600.0)))
                per_c = StageShares(srv)
                run = execute(specs, client_options(args, url), bench_config(args),
                              label="omniray", config={"serve_config": args.config, **vars(args)},
                              on_rounds=per_c)
                first = first_turn(run)
                print(f"[main] {first}", flush=True)
                (out / "main").mkdir(parents=True, exist_ok=True)
                from deployments.profiling import format_profile

                for stage, pending in profiling:
                    got = pending.result()
                    (out / "main" / f"profile_{stage.lower()}.txt").write_text(
                        format_profile(got["stage"], got["steps"]))
                (out / "main" / "stages.json").write_text(json.dumps(per_c.rows, indent=1))
                text_run = None
                if args.text_concurrency:
                    text_specs = load_specs(argparse.Namespace(**{**vars(args),
                                                                  "input_mode": "text"}))
                    text_run = execute(text_specs, client_options(args, url),
                                       bench_config(args, _ints(args.text_concurrency)),
                                       label="omniray text-only",
                                       config={"serve_config": args.config, **vars(args),
                                               "input_mode": "text"})
            base_path = out / "baseline" / "run.json"
            baseline = load_run(base_path) if base_path.exists() else None
            print(write_outputs(run, out / "main", baseline, plots=not args.no_plots,
                                targets=True), flush=True)
            with (out / "main" / "report.txt").open("a") as f:  # kept with the run's numbers
                f.write(f"\n{first}\n")
            failed += _failed(run)
            if text_run is not None:
                print(write_outputs(text_run, out / "text", None, plots=not args.no_plots),
                      flush=True)
                failed += _failed(text_run)
        if "attribution" in phases and args.knob:
            cfg = bench_config(args, _ints(args.attr_concurrency))
            cfg = replace(cfg, num_prompts=args.attr_num_prompts or cfg.num_prompts,
                          num_rounds=args.attr_rounds,
                          num_warmups=args.attr_warmups or cfg.num_warmups)
            attr_out = out / "attribution"

            def launch(v: Variant):
                over = (*base_over, *v.overrides)
                args_v = app_args(args.config, args.checkpoint, over, media_dir)
                return srv.app(args_v, v.label, attr_out / _slug(v.label))

            knobs, base_run = [parse_knob(k) for k in args.knob], None
            if args.attr_resume:
                done = collect([args.attr_resume])
                base_run, labels = done.base, {v.label for v, _, _ in done.variants}
                knobs = [k for k in knobs if k.label not in labels]
                print(f"resuming {args.attr_resume}: {len(labels)} done, {len(knobs)} to run")
            result = run_attribution(knobs, CallbackLauncher(launch), specs,
                                     client_options(args), cfg, out_dir=attr_out,
                                     base_run=base_run)
            print(format_attribution(result), flush=True)
            failed += bool(result.errors)
    finally:
        srv.close()
    print("PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in s)[:60]


if __name__ == "__main__":
    sys.exit(main())
