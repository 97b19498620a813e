"""Knob attribution: A/B runs that each change one serving knob, and a table of relative deltas.

    python -m bench.attribution --serve-config serve_config.yaml --url http://127.0.0.1:8000 \\
        --knob compile_mm_encoder=false --knob token2wav_cfm_cuda_graph=false \\
        --knob applications.0.args.talker.engine.cuda_graphs=false \\
        --dataset synthetic --synthetic-durations 30 \\
        --concurrency 1,4 --num-prompts 20 --rounds 1 --warmups 2 \\
        --fixed-text-tokens 16 --fixed-speech-codes 57 --out results/attribution

For each variant (A = the config as written, then one B per --knob):
  1. write a copy of the serve config with the override applied (`apply_overrides`),
  2. start `serve run <copy>` (--launch-cmd) in its own process group, wait until the API answers,
  3. run the benchmark (same data, options and load for every variant),
  4. stop the server (SIGINT to its group, then SIGTERM / SIGKILL) and wait for the port to free.
Then every B is compared with A: delta = (B - A) / A per headline metric and concurrency.
A B whose server does not come up (or whose run raises) is reported and skipped. Each run is
saved under --out as soon as it ends, so long sweeps can be split over several invocations:
`--base-run <out>/base/run.json` reuses an A, and `--collect DIR [DIR ...]` prints the table
of everything saved.

Where a knob lives in the YAML: `a.b.0.c=value` is a dotted path; a bare name is replaced
wherever that key already occurs (all occurrences), or added to every application's `args`
when it occurs nowhere. Values are parsed as YAML scalars (false, 0, 1.5, sdpa).
One --knob may set several keys at once:
`--knob token2wav_cfm_cuda_graph=false,token2wav_initial_state_cache=false`.

Without a serve config, point at servers that already run: `--url` is A and each
`--variant-url 'compile_mm_encoder=false@http://127.0.0.1:8001'` is a B. From Python, pass any
launcher (`CallbackLauncher`) to `run_attribution`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence
from urllib.parse import urlparse

import yaml

from bench.client import BenchConfig, ClientOptions, RequestSpec, wait_ready
from bench.metrics import headline

# issue 5's knobs as serve_config.yaml spells them (Talker graphs: talker.engine.cuda_graphs)
KNOWN_KNOBS = (
    "compile_mm_encoder",
    "vision_attn_backend",
    "token2wav_cfm_cuda_graph",
    "token2wav_initial_state_cache",
    "code2wav_batch_wait_ms",
    "active_stream_window",
    "applications.0.args.talker.engine.cuda_graphs",
)


@dataclass(frozen=True)
class Variant:
    """A named set of overrides; the base variant has none."""

    label: str
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def is_base(self) -> bool:
        return not self.overrides


def parse_sets(sets: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """--set arguments (each 'a=1' or 'a=1,b=2') -> the overrides `apply_overrides` takes."""
    return parse_knob(",".join(sets)).overrides if sets else ()


def parse_knob(spec: str) -> Variant:
    """'a=false,b=3' -> Variant('a=false,b=3', (('a', False), ('b', 3)))."""
    pairs = []
    for part in spec.split(","):
        if "=" not in part:
            raise ValueError(f"knob {part!r} is not name=value")
        k, v = part.split("=", 1)
        pairs.append((k.strip(), yaml.safe_load(v.strip()) if v.strip() else ""))
    return Variant(spec, tuple(pairs))


# ----------------------------------------------------------------------------- YAML overrides


def _key_paths(tree: Any, key: str, path: tuple = ()) -> list[tuple]:
    found = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == key:
                found.append(path + (k,))
            found.extend(_key_paths(v, key, path + (k,)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            found.extend(_key_paths(v, key, path + (i,)))
    return found


def _set_path(tree: Any, path: Sequence[Any], value: Any) -> None:
    node = tree
    for p in path[:-1]:
        if isinstance(node, list):
            node = node[int(p)]
        else:
            node = node.setdefault(p, {})
    last = path[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def apply_overrides(config: dict[str, Any], overrides: Sequence[tuple[str, Any]]
                    ) -> tuple[dict[str, Any], list[str]]:
    """A deep copy of `config` with the overrides set, and where each one went."""
    cfg = copy.deepcopy(config)
    where: list[str] = []
    for key, value in overrides:
        if "." in key:
            path = [int(p) if p.isdigit() else p for p in key.split(".")]
            _set_path(cfg, path, value)
            where.append(key)
            continue
        paths = _key_paths(cfg, key)
        if not paths:
            apps = cfg.get("applications") if isinstance(cfg, dict) else None
            if apps:
                paths = [("applications", i, "args", key) for i in range(len(apps))]
            else:
                paths = [(key,)]
        for p in paths:
            _set_path(cfg, p, value)
            where.append(".".join(str(x) for x in p))
    return cfg, where


# ----------------------------------------------------------------------------- launchers


class Launcher(Protocol):
    def serve(self, variant: Variant) -> ContextManager[str]:
        """Context manager: a ready server for `variant`; yields its base URL."""
        ...


class UrlLauncher:
    """Servers that already run: base URL for A, one URL per variant label for each B."""

    def __init__(self, base_url: str, variant_urls: dict[str, str] | None = None,
                 ready_timeout_s: float = 60.0) -> None:
        self.base_url, self.variant_urls = base_url, dict(variant_urls or {})
        self.ready_timeout_s = ready_timeout_s

    @contextlib.contextmanager
    def serve(self, variant: Variant) -> Iterator[str]:
        url = self.base_url if variant.is_base else self.variant_urls[variant.label]
        asyncio.run(wait_ready(url, self.ready_timeout_s))
        yield url


class CallbackLauncher:
    """Wraps `fn(variant) -> ContextManager[url]` (e.g. a GPU script's own launcher)."""

    def __init__(self, fn: Callable[[Variant], ContextManager[str]]) -> None:
        self.fn = fn

    def serve(self, variant: Variant) -> ContextManager[str]:
        return self.fn(variant)


class ServeRunLauncher:
    """Starts `serve run <config copy>` per variant and stops it afterwards.

    launch_cmd: a template with {config}; run in a new session (its own process group) so the
    whole tree (Ray workers included) can be signalled at stop. Logs go to log_dir/<label>.log.
    """

    def __init__(
        self,
        serve_config: str | os.PathLike,
        url: str,
        launch_cmd: str = "serve run {config}",
        log_dir: str | os.PathLike | None = None,
        ready_timeout_s: float = 1200.0,
        stop_timeout_s: float = 90.0,
        post_stop_cmd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        with open(serve_config) as f:
            self.config = yaml.safe_load(f)
        self.config_dir = Path(serve_config).resolve().parent
        self.url = url
        self.launch_cmd = launch_cmd
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="omniray-attr-"))
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.post_stop_cmd = post_stop_cmd
        self.env = env
        self.placements: dict[str, list[str]] = {}

    def write_config(self, variant: Variant) -> Path:
        cfg, where = apply_overrides(self.config, variant.overrides)
        self.placements[variant.label] = where
        # next to the original so relative paths inside it keep working
        fd, name = tempfile.mkstemp(prefix=f".attr-{_slug(variant.label)}-", suffix=".yaml",
                                    dir=self.config_dir)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        return Path(name)

    @contextlib.contextmanager
    def serve(self, variant: Variant) -> Iterator[str]:
        cfg_path = self.write_config(variant)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{_slug(variant.label)}.log"
        cmd = [a.replace("{config}", str(cfg_path)) for a in shlex.split(self.launch_cmd)]
        print(f"[attribution] {variant.label}: {' '.join(cmd)} (log {log_path})", file=sys.stderr)
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(self.env or {})})
        try:
            asyncio.run(wait_ready(self.url, self.ready_timeout_s,
                                   is_alive=lambda: proc.poll() is None))
            yield self.url
        finally:
            self._stop(proc)
            log.close()
            cfg_path.unlink(missing_ok=True)
            if self.post_stop_cmd:
                subprocess.run(shlex.split(self.post_stop_cmd), check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_port_free(self.url, self.stop_timeout_s)

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGINT (serve run shuts Serve down cleanly), then SIGTERM, then SIGKILL, by group."""
        for sig, wait in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGTERM, 15.0),
                          (signal.SIGKILL, 15.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the group this launcher created for its child
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        # children that outlived the leader (same group, started by us)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:80] or "base"


def _wait_port_free(url: str, timeout_s: float) -> None:
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) != 0:
                return
        time.sleep(0.5)


# ----------------------------------------------------------------------------- running


@dataclass
class AttributionResult:
    """A's run, each B's run with the A it is compared with, and the Bs that failed."""

    base: dict[str, Any]  # run JSON of A
    variants: list[tuple[Variant, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # variant label -> why it has no run

    def deltas(self) -> list[dict[str, Any]]:
        """One row per (variant, concurrency): headline of A and B and (B - A) / A."""
        rows = []
        for v, run_b, run_a in self.variants:
            for c in sorted(run_b["summaries"], key=int):
                a = run_a["summaries"].get(c)
                if a is None:
                    continue
                ha, hb = headline(a), headline(run_b["summaries"][c])
                rows.append({
                    "knob": v.label,
                    "concurrency": int(c),
                    "a": ha,
                    "b": hb,
                    "delta": {k: _delta(hb[k], ha[k]) for k in ha},
                    "failed_b": run_b["summaries"][c]["failed"],
                })
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base["summaries"],
            "variants": [{"label": v.label, "overrides": [list(o) for o in v.overrides],
                          "summaries": r["summaries"]} for v, r, _ in self.variants],
            "errors": self.errors,
            "deltas": self.deltas(),
        }

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "attribution.json").write_text(json.dumps(self.to_json(), indent=1))
        (out / "attribution.txt").write_text(format_attribution(self) + "\n")


def _delta(b: float, a: float) -> float:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a == 0:
        return float("nan")
    return (b - a) / a


def run_attribution(
    variants: Sequence[Variant],
    launcher: Launcher,
    specs: Sequence[RequestSpec],
    opts: ClientOptions,
    cfg: BenchConfig,
    out_dir: str | os.PathLike | None = None,
    repeat_base: bool = False,
    base_run: dict[str, Any] | None = None,
    execute_fn: Callable[..., dict[str, Any]] | None = None,
) -> AttributionResult:
    """Run A (unless `base_run` gives it), then each B; re-run A before each B if `repeat_base`.

    A B whose server fails to start or whose run raises is recorded in `errors` and skipped.
    With out_dir, every run is saved as <out>/<tag>/run.json as soon as it ends, and
    attribution.json/.txt are rewritten after each B (a run cut short keeps what it has).
    execute_fn defaults to bench.cli.execute (same signature).
    """
    if execute_fn is None:
        from bench.cli import execute as execute_fn  # late import: cli imports this module
    from bench.report import save_run

    out = Path(out_dir) if out_dir else None
    base_v = Variant("base")

    def one(v: Variant, tag: str) -> dict[str, Any]:
        with launcher.serve(v) as url:
            run = execute_fn(specs, _with_url(opts, url), cfg, label=v.label,
                             config={"variant": v.label,
                                     "overrides": [list(o) for o in v.overrides]})
        if out is not None:
            save_run(run, out / tag / "run.json")
        return run

    base = base_run if base_run is not None else one(base_v, "base")
    result = AttributionResult(base)
    for i, v in enumerate(variants):
        try:
            a = one(base_v, f"base_{i:02d}") if repeat_base and i > 0 else base
            result.variants.append((v, one(v, f"{i:02d}_{_slug(v.label)}"), a))
        except Exception as e:  # noqa: BLE001 - one broken config must not lose the others
            result.errors[v.label] = f"{type(e).__name__}: {e}"
            print(f"[attribution] {v.label} failed: {result.errors[v.label]}", file=sys.stderr)
        if out is not None:
            result.save(out)
    if out is not None:
        result.save(out)
    return result


def collect(dirs: Sequence[str | os.PathLike], base_run: str | os.PathLike | None = None
            ) -> AttributionResult:
    """Rebuild the table from saved runs (<dir>/<tag>/run.json) of one or more invocations.

    A is `base_run`, else the first <dir>/base/run.json found; every other run is a B, with
    its overrides read back from the run's config.
    """
    from bench.report import load_run

    base = load_run(base_run) if base_run else None
    bs: list[tuple[str, dict[str, Any]]] = []
    for d in dirs:
        for p in sorted(Path(d).glob("*/run.json")):
            run = load_run(p)
            label = (run.get("config") or {}).get("variant", p.parent.name)
            if label == "base":
                if base is None:
                    base = run
                continue
            bs.append((label, run))
    if base is None:
        raise FileNotFoundError(f"no base run in {list(dirs)} (give --base-run)")
    result = AttributionResult(base)
    for label, run in bs:
        ov = tuple(tuple(o) for o in (run.get("config") or {}).get("overrides", []))
        result.variants.append((Variant(label, ov), run, base))  # type: ignore[arg-type]
    return result


def _with_url(opts: ClientOptions, url: str) -> ClientOptions:
    from dataclasses import replace

    return replace(opts, url=url)


_ATTR_COLS = [("req/s", "request_throughput"), ("audio-s/s", "audio_throughput"),
              ("TTFT", "ttft_ms"), ("TTFP", "audio_ttfp_ms"), ("RTF", "audio_rtf"),
              ("E2E", "e2el_ms")]


def format_attribution(result: AttributionResult) -> str:
    """Relative deltas (B - A) / A; '!' marks a change for the worse."""
    from bench.report import _fmt, _render, format_delta

    header = ["knob (B)", "c", *(h for h, _ in _ATTR_COLS), "fail"]
    rows = []
    for c in sorted(result.base["summaries"], key=int):
        h = headline(result.base["summaries"][c])
        rows.append(["A: base", c, _fmt(h["request_throughput"], 2),
                     _fmt(h["audio_throughput"], 2), _fmt(h["ttft_ms"], 0) + "ms",
                     _fmt(h["audio_ttfp_ms"], 0) + "ms", _fmt(h["audio_rtf"], 3),
                     _fmt(h["e2el_ms"], 0) + "ms", str(result.base["summaries"][c]["failed"])])
    for row in result.deltas():
        rows.append([row["knob"], str(row["concurrency"]),
                     *(format_delta(k, row["delta"][k]) for _, k in _ATTR_COLS),
                     str(row["failed_b"])])
    text = ("knob attribution: relative change of B (one knob changed) vs A (base config); "
            "'!' = worse\n" + _render(rows, header))
    for label, why in result.errors.items():
        text += f"\n{label}: no result ({why})"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    from bench.cli import add_client_args, add_data_args, bench_config, client_options, load_specs
    from bench.report import load_run

    ap = argparse.ArgumentParser(prog="python -m bench.attribution",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_client_args(ap)
    add_data_args(ap)
    ap.add_argument("--knob", action="append", default=[],
                    help="name=value[,name2=value2]: one B variant (repeat for more)")
    ap.add_argument("--serve-config", default=None, help="Serve YAML; enables launching")
    ap.add_argument("--launch-cmd", default="serve run {config}")
    ap.add_argument("--post-stop-cmd", default=None, help="e.g. 'ray stop' after each server")
    ap.add_argument("--ready-timeout", type=float, default=1200.0)
    ap.add_argument("--variant-url", action="append", default=[],
                    help="'name=value@URL': a B that already runs (no --serve-config)")
    ap.add_argument("--repeat-base", action="store_true", help="re-run A before every B")
    ap.add_argument("--base-run", default=None,
                    help="run.json of an earlier A (same data and load): A is not re-run")
    ap.add_argument("--collect", nargs="+", default=None, metavar="DIR",
                    help="only print the table from saved attribution folders")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.collect:
        print(format_attribution(collect(args.collect, args.base_run)))
        return 0
    variants = [parse_knob(k) for k in args.knob]
    if args.serve_config:
        launcher: Launcher = ServeRunLauncher(
            args.serve_config, args.url, args.launch_cmd,
            log_dir=Path(args.out) / "logs" if args.out else None,
            ready_timeout_s=args.ready_timeout, post_stop_cmd=args.post_stop_cmd)
    else:
        urls = {}
        for vu in args.variant_url:
            label, url = vu.rsplit("@", 1)
            urls[label] = url
            if label not in {v.label for v in variants}:
                variants.append(parse_knob(label))
        missing = [v.label for v in variants if v.label not in urls]
        if missing:
            ap.error(f"no --variant-url for {missing} (or pass --serve-config)")
        launcher = UrlLauncher(args.url, urls, ready_timeout_s=args.ready_timeout)
    if not variants:
        ap.error("give at least one --knob")
    specs = load_specs(args)
    result = run_attribution(variants, launcher, specs, client_options(args), bench_config(args),
                             out_dir=args.out, repeat_base=args.repeat_base,
                             base_run=load_run(args.base_run) if args.base_run else None)
    print(format_attribution(result))
    return 1 if result.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
