"""Command line: `python -m bench {run,synth,report,soak,duplex} ...`.

Examples (docs/bench.md has more):
  # synthetic 30 s clips, fixed-length output for random weights, c=1 and c=4
  python -m bench run --url http://127.0.0.1:8000 --dataset synthetic --data-dir /tmp/syn \\
      --synthetic-durations 30 --concurrency 1,4 --num-prompts 20 --rounds 3 --warmups 4 \\
      --fixed-text-tokens 16 --fixed-speech-codes 57 --out results/run --baseline base.json
  # Daily-Omni in its published layout
  python -m bench run --dataset daily-omni --data-dir /data/Daily-Omni --durations 30s ...
  python -m bench report results/run/run.json --baseline results/base/run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.client import BenchConfig, ClientOptions, RequestSpec, run_benchmark
from bench.datasets import (
    extract_choice_letter,
    load_daily_omni,
    make_specs,
    make_synthetic_daily_omni,
)
from bench.metrics import DEFAULT_PERCENTILES, RequestRecord
from bench.report import (
    APP_TARGETS,
    build_run,
    format_report,
    load_run,
    plot_run,
    save_run,
)


def _grade(rec: RequestRecord, spec: RequestSpec) -> None:
    if rec.answer is not None:
        rec.predicted = extract_choice_letter(rec.text)


def execute(
    specs: Sequence[RequestSpec],
    opts: ClientOptions,
    cfg: BenchConfig,
    label: str = "run",
    config: dict[str, Any] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    on_rounds: Callable[[int, str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return the run JSON (report.build_run)."""
    results = asyncio.run(run_benchmark(specs, opts, cfg, on_record=_grade, on_rounds=on_rounds))
    return build_run(results, config or {}, label=label, percentiles=percentiles)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _size(s: str) -> tuple[int, int]:
    w, h = s.lower().split("x")
    return int(w), int(h)


def add_data_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data")
    g.add_argument("--dataset", choices=["synthetic", "daily-omni"], default="synthetic")
    g.add_argument("--data-dir", default="bench_data/synthetic",
                   help="Daily-Omni root (qa.json, Videos/) or where the synthetic set lives")
    g.add_argument("--qa-json", default=None,
                   help="Daily-Omni qa.json (default <data-dir>/qa.json)")
    g.add_argument("--videos-dir", default=None, help="default <data-dir>/Videos")
    g.add_argument("--durations", default=None,
                   help="keep only these video_duration buckets, e.g. 30s or 30s,60s")
    g.add_argument("--limit", type=int, default=None, help="use at most this many items")
    g.add_argument("--synthetic-num", type=int, default=None,
                   help="clips to generate (default: warmups + rounds * num-prompts per "
                        "concurrency, at most 400: no clip is sent twice)")
    g.add_argument("--synthetic-durations", default="30",
                   help="clip seconds, cycled over the clips (e.g. 30,60)")
    g.add_argument("--synthetic-size", default="448x448", help="WxH of generated video")
    g.add_argument("--synthetic-fps", type=int, default=5)
    g.add_argument("--synthetic-workers", type=int, default=os.cpu_count() or 1,
                   help="processes generating clips")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--pack", choices=["video", "interleave", "track"], default="video",
                   help="video: video_url + audio part (server packs 1 fps pairs); "
                        "interleave: client sends 1 fps JPEG + 1 s wav pairs; "
                        "track: one video_url whose MP4 carries the wav as an AAC track")
    g.add_argument("--input-mode", choices=["all", "visual", "audio", "text"], default="all",
                   help="text: the question alone, no media (speech still asked for)")
    g.add_argument("--audio-style", choices=["input_audio", "audio_url"], default="input_audio")
    g.add_argument("--max-pairs", type=int, default=64)
    g.add_argument("--media", choices=["data", "file"], default="data",
                   help="data: inline base64 data: URIs; file: file:// URLs (server on the same "
                        "host, folder allowed by its allowed_local_media_path)")


def add_client_args(ap: argparse.ArgumentParser, with_url: bool = True) -> None:
    g = ap.add_argument_group("requests")
    if with_url:
        g.add_argument("--url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/chat/completions")
    g.add_argument("--model", default="omniray")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--text-only", action="store_true", help="modalities=[text]")
    g.add_argument("--fixed-text-tokens", type=int, default=None,
                   help="fixed-length mode: exactly N Thinker text tokens (random weights)")
    g.add_argument("--fixed-speech-codes", type=int, default=None,
                   help="fixed-length mode: exactly N Talker codes (57 = 2.28 s)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-timings", action="store_true", help="do not ask for per-stage timings")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", default="1", help="closed-loop concurrency list, e.g. 1,4")
    g.add_argument("--num-prompts", type=int, default=20, help="requests per measured round")
    g.add_argument("--rounds", type=int, default=3, help="measured rounds per concurrency")
    g.add_argument("--warmups", type=int, default=2, help="uncounted requests per concurrency")
    g.add_argument("--percentiles", default="50,90,95,99")
    g.add_argument("--no-progress", action="store_true")


def client_options(args: argparse.Namespace, url: str | None = None) -> ClientOptions:
    return ClientOptions(
        url=url or args.url,
        endpoint=args.endpoint,
        model=args.model,
        max_tokens=args.max_tokens,
        modalities=("text",) if args.text_only else ("text", "audio"),
        return_timings=not args.no_timings,
        ignore_eos=args.ignore_eos,
        fixed_text_tokens=args.fixed_text_tokens,
        fixed_speech_codes=args.fixed_speech_codes,
        extra_body=json.loads(args.extra_body) if args.extra_body else {},
        timeout_s=args.timeout,
    )


def bench_config(args: argparse.Namespace, concurrencies: Sequence[int] | None = None
                 ) -> BenchConfig:
    return BenchConfig(
        concurrencies=tuple(concurrencies or _ints(args.concurrency)),
        num_prompts=args.num_prompts,
        num_rounds=args.rounds,
        num_warmups=args.warmups,
        progress=not args.no_progress,
    )


def load_specs(args: argparse.Namespace) -> list[RequestSpec]:
    """Build (and for synthetic, first generate) the request specs."""
    durations = tuple(args.durations.split(",")) if args.durations else None
    if args.dataset == "synthetic":
        n = args.synthetic_num
        if n is None:
            per_c = args.warmups + args.rounds * args.num_prompts
            n = min(400, per_c * len(_ints(args.concurrency)))  # no clip seen twice
        make_synthetic_daily_omni(
            args.data_dir,
            num_videos=n,
            durations=_floats(args.synthetic_durations),
            seed=args.seed,
            size=_size(args.synthetic_size),
            fps=args.synthetic_fps,
            workers=args.synthetic_workers,
        )
    items = load_daily_omni(args.data_dir, qa_json=args.qa_json, videos_dir=args.videos_dir,
                            limit=args.limit, durations=durations)
    if not items:
        raise SystemExit(f"no usable items under {args.data_dir}")
    return make_specs(items, pack=args.pack, input_mode=args.input_mode,
                      audio_style=args.audio_style, max_pairs=args.max_pairs,
                      transport=args.media)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as stored in its JSON."""
    d = {k: v for k, v in vars(args).items() if k not in ("func",)}
    return json.loads(json.dumps(d, default=str))


def write_outputs(run: dict[str, Any], out: Path | None, baseline: dict[str, Any] | None,
                  plots: bool = True, targets: bool = False) -> str:
    text = format_report(run, baseline, APP_TARGETS if targets else None)
    if out is not None:
        save_run(run, out / "run.json")
        (out / "report.txt").write_text(text + "\n")
        if plots:
            written = plot_run(run, out, baseline=baseline)
            if not written:
                print("matplotlib not installed: no plots", file=sys.stderr)
    return text


def cmd_run(args: argparse.Namespace) -> int:
    specs = load_specs(args)
    pct = _floats(args.percentiles)
    out = Path(args.out) if args.out else None
    baseline = load_run(args.baseline) if args.baseline else None
    if args.baseline_url:
        print(f"baseline: {args.baseline_url} at c={args.baseline_concurrency}", file=sys.stderr)
        baseline = execute(specs, client_options(args, args.baseline_url),
                           bench_config(args, _ints(args.baseline_concurrency)),
                           label=args.baseline_label, config=run_config(args), percentiles=pct)
        if out is not None:
            write_outputs(baseline, out / "baseline", None, plots=not args.no_plots)
    run = execute(specs, client_options(args), bench_config(args), label=args.label,
                  config=run_config(args), percentiles=pct)
    print(write_outputs(run, out, baseline, plots=not args.no_plots, targets=args.targets))
    if out is not None:
        print(f"\nwrote {out / 'run.json'}", file=sys.stderr)
    failed = sum(s["failed"] for s in run["summaries"].values())
    return 1 if failed and args.fail_on_error else 0


def cmd_synth(args: argparse.Namespace) -> int:
    root = make_synthetic_daily_omni(args.out, num_videos=args.num,
                                     durations=_floats(args.durations), seed=args.seed,
                                     size=_size(args.size), fps=args.fps, overwrite=args.overwrite,
                                     workers=args.workers)
    print(f"wrote {args.num} clips under {root}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    run = load_run(args.run)
    baseline = load_run(args.baseline) if args.baseline else None
    print(format_report(run, baseline, APP_TARGETS if args.targets else None))
    if args.plots:
        for p in plot_run(run, args.plots, baseline=baseline):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description="omniray benchmark harness")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="benchmark a running server")
    add_client_args(r)
    add_data_args(r)
    r.add_argument("--out", default=None, help="folder for run.json, report.txt and PNGs")
    r.add_argument("--label", default="omniray")
    r.add_argument("--baseline", default=None, help="run.json of a baseline run (ratios)")
    r.add_argument("--baseline-url", default=None,
                   help="also benchmark this server first (the baseline) and compare")
    r.add_argument("--baseline-concurrency", default="1")
    r.add_argument("--baseline-label", default="baseline")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--fail-on-error", action="store_true", help="exit 1 if a request failed")
    r.add_argument("--targets", action="store_true",
                   help="also check the app benchmark's targets (30 s clips, c=1 and c=4)")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("synth", help="write a synthetic Daily-Omni-shaped data set")
    s.add_argument("--out", required=True)
    s.add_argument("--num", type=int, default=20)
    s.add_argument("--durations", default="30,60")
    s.add_argument("--size", default="448x448")
    s.add_argument("--fps", type=int, default=5)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--overwrite", action="store_true")
    s.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    s.set_defaults(func=cmd_synth)

    p = sub.add_parser("report", help="print tables (and plots) of a saved run")
    p.add_argument("run")
    p.add_argument("--baseline", default=None)
    p.add_argument("--plots", default=None, help="folder to write PNGs into")
    p.add_argument("--targets", action="store_true", help="also check the app benchmark's targets")
    p.set_defaults(func=cmd_report)

    sub.add_parser("duplex", help="realtime-paced full-duplex sessions: decision and first-audio "
                   "latency, units behind, underruns (see python -m bench duplex -h)", add_help=False)
    sub.add_parser("soak", help="many turns of every kind, hang-ups, a stage killed; then "
                   "check nothing leaked (see python -m bench soak -h)", add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "duplex":
        from bench.duplex import main as duplex_main

        return duplex_main(argv[1:])
    if argv and argv[0] == "soak":
        from bench.soak import main as soak_main

        return soak_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
