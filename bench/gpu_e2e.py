"""The app benchmark in one process: the app started in-process on one Ray instance
(`deployments.app.build_app` over its Serve config), then the closed-loop client against it.

    python -m bench.gpu_e2e --phases main --checkpoint random-full --data-dir /tmp/syn \\
        --synthetic-durations 30 --media file --fixed-text-tokens 16 --fixed-speech-codes 57 \\
        --concurrency 1,4,8 --text-concurrency 1,8 --num-prompts 20 --rounds 3 --warmups 4 \\
        --no-plots --no-progress --out /tmp/r/e2e

Outputs under <out>/main and <out>/text, the stages' stats and per-concurrency engine
counters beside them (docs/bench.md). Exits 1 if a request failed. Needs Ray Serve.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

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

STAGES = ("Thinker", "Talker", "Code2Wav")


def parse_sets(sets: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """--set arguments (each 'a=1' or 'a=1,b=2') -> ((key, YAML-parsed value), ...)."""
    pairs = []
    for part in (p for s in sets for p in s.split(",") if p.strip()):
        if "=" not in part:
            raise ValueError(f"--set {part!r} is not key=value")
        k, v = part.split("=", 1)
        pairs.append((k.strip(), yaml.safe_load(v.strip()) if v.strip() else ""))
    return tuple(pairs)


def apply_overrides(tree: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of a Serve YAML tree with the overrides set: `a.0.b` is a dotted path; a bare
    key is replaced wherever it occurs, or added to every application's `args`."""
    tree = copy.deepcopy(tree)
    for key, value in overrides:
        if "." in key:
            paths = [[int(p) if p.isdigit() else p for p in key.split(".")]]
        else:
            paths = _key_paths(tree, key) or [
                ["applications", i, "args", key] for i in range(len(tree["applications"]))]
        for path in paths:
            node = tree
            for p in path[:-1]:
                node = node[p] if isinstance(node, list) else node.setdefault(p, {})
            node[path[-1]] = value
    return tree


def _key_paths(node: Any, key: str, path: tuple = ()) -> list[list]:
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    found = []
    for k, v in items:
        if k == key and isinstance(node, dict):
            found.append([*path, k])
        found.extend(_key_paths(v, key, (*path, k)))
    return found


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(config_path: str, model: str | None, overrides=(), media_dir: str | None = None
             ) -> dict[str, Any]:
    """The app's `args` from a Serve YAML, with `model` and the overrides applied; `media_dir`
    is where file:// media may be read from (`--media file`, as vLLM-Omni's bench sends them)."""
    with open(config_path) as f:
        tree = apply_overrides(yaml.safe_load(f), overrides)
    args = tree["applications"][0]["args"]
    if model is not None:
        args["model"] = model
    if media_dir is not None:
        args["allowed_local_media_path"] = str(Path(media_dir).resolve())
    return args


def stage_names(stage: str, groups: int) -> list[str]:
    """One deployment name per group of a stage: `Code2Wav`, or `Code2Wav-g0`, ..."""
    return [stage] if groups == 1 else [f"{stage}-g{g}" for g in range(groups)]


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
        from deployments.app import build_app

        t = time.perf_counter()
        self.serve.run(build_app(args), name="omniray", route_prefix="/")
        self.groups = len(self.ingress_stats().get("groups", [None]))
        # the Serve settings this process's Ray was started with move the serving path's ms
        serve_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
        print(f"[{label}] app RUNNING after {time.perf_counter() - t:.1f} s "
              f"({self.groups} group(s); Serve environment {serve_env or 'default'})", flush=True)
        try:
            print(f"[{label}] {attention_note(self.first('Thinker').stats.remote().result())}",
                  flush=True)
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
        return stage_names(stage, self.groups)

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
    ap.add_argument("--phases", default="main", choices=["main"],
                    help="kept for the recorded commands: the app's run is the one phase")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--checkpoint", default=None, help="overrides the config's `model` (e.g. random-full)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override in --config: a dotted path or a bare key (a=1,b=2 allowed)")
    ap.add_argument("--text-concurrency", default="",
                    help="also run the questions alone (no media) at these c")
    ap.add_argument("--groups", default=None,
                    help="stage groups (N or auto; one GPU each); reports per-group load")
    ap.add_argument("--profile-first-turn", default=None, metavar="STAGE:N[,STAGE:N...]",
                    help="profile each STAGE's (Thinker, Talker, Code2Wav) first N steps after "
                         "RUNNING")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-plots", action="store_true")
    add_client_args(ap, with_url=False)
    add_data_args(ap)
    args = ap.parse_args(argv)
    args.url = "http://127.0.0.1:0"  # replaced by the app's
    out = Path(args.out)
    sets = [*args.set, *([f"applications.0.args.groups={args.groups}"] if args.groups else [])]
    app = app_args(args.config, args.checkpoint, parse_sets(sets),
                   args.data_dir if args.media == "file" else None)
    specs = load_specs(args)
    print(f"{len(specs)} request specs from {args.data_dir}", flush=True)
    srv = InProcessServe()
    try:
        with srv.app(app, "main", out / "main") as url:
            run, text_run, first = main_phase(srv, args, specs, url, out / "main")
    finally:
        srv.close()
    print(write_outputs(run, out / "main", None, plots=not args.no_plots, targets=True),
          flush=True)
    with (out / "main" / "report.txt").open("a") as f:  # kept with the run's numbers
        f.write(f"\n{first}\n")
    failed = _failed(run)
    if text_run is not None:
        print(write_outputs(text_run, out / "text", None, plots=not args.no_plots), flush=True)
        failed += _failed(text_run)
    print("PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


def main_phase(srv: InProcessServe, args: argparse.Namespace, specs: list, url: str, out: Path
               ) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """The runs on the app: clips at --concurrency, then text alone at --text-concurrency."""
    profiling = []
    for spec in filter(None, (args.profile_first_turn or "").split(",")):
        stage, _, n = spec.strip().partition(":")
        profiling.append((stage, srv.first(stage).profile.remote(int(n or 40), 600.0)))
    per_c = StageShares(srv)
    config = {"serve_config": args.config, **vars(args)}
    run = execute(specs, client_options(args, url), bench_config(args), label="omniray",
                  config=config, on_rounds=per_c)
    first = first_turn(run)
    print(f"[main] {first}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for stage, pending in profiling:
        (out / f"profile_{stage.lower()}.json").write_text(
            json.dumps(pending.result(), indent=1, default=str))
    (out / "stages.json").write_text(json.dumps(per_c.rows, indent=1))
    text_run = None
    if args.text_concurrency:
        text_specs = load_specs(argparse.Namespace(**{**vars(args), "input_mode": "text"}))
        text_run = execute(text_specs, client_options(args, url),
                           bench_config(args, _ints(args.text_concurrency)),
                           label="omniray text-only", config={**config, "input_mode": "text"})
    return run, text_run, first


if __name__ == "__main__":
    sys.exit(main())
