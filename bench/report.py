"""Run results: the JSON file, terminal tables (optionally as ratios to a baseline) and plots.

Run JSON (`build_run` / `save_run` / `load_run`), schema "omniray-bench/1":
    label, created, config               what ran and how
    summaries    {"<c>": summary}         metrics.summarize per concurrency
    rounds       [{concurrency, round, warmup, duration_s, requests: [timeline, ...]}]
                 every request's timeline, times in seconds since its round started
                 (metrics.RequestRecord.timeline)

Baseline: `--baseline run.json` loads another run; every headline figure is also printed as
this run / baseline, against the baseline summary of the same concurrency, or of its lowest
concurrency when it has no such one (a baseline is usually run at c=1 only).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from bench.metrics import (
    DEFAULT_PERCENTILES,
    RequestRecord,
    RoundResult,
    headline,
    ratio,
    summarize,
)

SCHEMA = "omniray-bench/1"


# ----------------------------------------------------------------------------- JSON


def build_run(
    results: dict[int, dict[str, Any]],
    config: dict[str, Any],
    label: str = "run",
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """JSON-ready run from `client.run_benchmark`'s result."""
    rounds_json: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    for c, entry in results.items():
        rounds: list[RoundResult] = entry["rounds"]
        summaries[str(c)] = summarize(rounds, percentiles)
        summaries[str(c)]["accuracy_by"] = accuracy_breakdown(
            [r for rnd in rounds for r in rnd.records]
        )
        all_rounds = ([entry["warmup"]] if entry.get("warmup") else []) + rounds
        for rnd in all_rounds:
            rounds_json.append(
                {
                    "concurrency": c,
                    "round": rnd.round,
                    "warmup": rnd.round < 0,
                    "duration_s": rnd.duration,
                    "throughput": rnd.throughput(),
                    "requests": [r.timeline(rnd.t_start) for r in rnd.records],
                }
            )
    return {
        "schema": SCHEMA,
        "label": label,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "summaries": summaries,
        "rounds": rounds_json,
    }


def save_run(run: dict[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1, default=_json_default)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_run(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    if run.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an {SCHEMA} file (schema={run.get('schema')!r})")
    return run


def run_records(run: dict[str, Any], concurrency: int | None = None,
                include_warmup: bool = False) -> list[RequestRecord]:
    """Records back from a run JSON (times relative to their round start)."""
    out = []
    for rnd in run["rounds"]:
        if rnd["warmup"] and not include_warmup:
            continue
        if concurrency is not None and rnd["concurrency"] != concurrency:
            continue
        out.extend(RequestRecord.from_timeline(d) for d in rnd["requests"])
    return out


def accuracy_breakdown(records: Sequence[RequestRecord]) -> dict[str, dict[str, list[int]]]:
    """{"type": {label: [correct, graded]}, "duration": {...}} over graded records."""
    out: dict[str, dict[str, list[int]]] = {"type": {}, "duration": {}}
    for r in records:
        if r.warmup or not r.ok or r.correct is None:
            continue
        for key in out:
            label = str(r.meta.get(key, "?"))
            cell = out[key].setdefault(label, [0, 0])
            cell[0] += int(bool(r.correct))
            cell[1] += 1
    return out


# ----------------------------------------------------------------------------- tables


def baseline_summary(baseline: dict[str, Any] | None, c: int) -> tuple[dict | None, int | None]:
    """The baseline summary to compare concurrency `c` against, and its concurrency."""
    if not baseline or not baseline.get("summaries"):
        return None, None
    sums = baseline["summaries"]
    if str(c) in sums:
        return sums[str(c)], c
    lowest = min(int(k) for k in sums)
    return sums[str(lowest)], lowest


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _fmt_ratio(r: float) -> str:
    return "-" if not math.isfinite(r) else f"x{r:.2f}"


_COLUMNS: list[tuple[str, str, int]] = [
    # (header, key in headline(), digits)
    ("req/s", "request_throughput", 2),
    ("audio-s/s", "audio_throughput", 2),
    ("TTFT ms", "ttft_ms", 1),
    ("TTFP ms", "audio_ttfp_ms", 1),
    ("RTF", "audio_rtf", 3),
    ("E2E ms", "e2el_ms", 1),
    ("max ITL ms", "max_itl_ms", 1),  # per request's largest text gap; not a headline figure
]


def _figures(summary: dict[str, Any]) -> dict[str, float]:
    """The table's figures: the headline plus the median of the per-request max ITL."""
    itl = summary.get("max_itl_ms", {}).get("median", float("nan"))
    return {**headline(summary), "max_itl_ms": itl}


def _render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    def just(cells: Sequence[str]) -> str:  # first column left, numbers right
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    line = just(header)
    sep = "  ".join("-" * w for w in widths)
    body = [just(r) for r in rows]
    return "\n".join([line, sep, *body])


def format_table(run: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """Headline table: one row per concurrency (medians; p90 in brackets), plus ratio rows."""
    header = ["c", *(h for h, _, _ in _COLUMNS), "ok", "fail", "acc"]
    rows: list[list[str]] = []
    for key in sorted(run["summaries"], key=int):
        s = run["summaries"][key]
        h = _figures(s)
        row = [key]
        for _, k, dg in _COLUMNS:
            cell = _fmt(h[k], dg)
            if k in ("ttft_ms", "audio_ttfp_ms", "e2el_ms", "audio_rtf", "max_itl_ms"):
                p90 = s.get(k, {}).get("p90")
                if p90 is not None and math.isfinite(p90):
                    cell += f" ({_fmt(p90, dg)})"
            row.append(cell)
        acc = s.get("accuracy")
        row += [str(s["completed"]), str(s["failed"]),
                "-" if acc is None else f"{100 * acc:.1f}%"]
        rows.append(row)
        b, bc = baseline_summary(baseline, int(key))
        if b is not None:
            bh = _figures(b)
            rrow = [f"/b{bc}"]
            for _, k, _ in _COLUMNS:
                rrow.append(_fmt_ratio(ratio(h[k], bh[k])))
            bacc = b.get("accuracy")
            rrow += ["", "", "-" if acc is None or not bacc else _fmt_ratio(acc / bacc)]
            rows.append(rrow)
    title = f"{run.get('label', 'run')}: medians (p90)"
    if baseline is not None:
        title += (f"; rows /bN = this run / baseline '{baseline.get('label', 'baseline')}'"
                  " at concurrency N")
    return title + "\n" + _render(rows, header)


def format_stages(run: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """Median milliseconds per server stage and concurrency (needs server timings)."""
    stages: list[str] = []
    for s in run["summaries"].values():
        for k in s.get("stages_ms", {}):
            if k not in stages:
                stages.append(k)
    if not stages:
        return "no per-stage timings in this run (server did not return `timings`)"
    header = ["c", *stages]
    rows = []
    for key in sorted(run["summaries"], key=int):
        st = run["summaries"][key].get("stages_ms", {})
        rows.append([key, *(_fmt(st.get(k, {}).get("median"), 1) for k in stages)])
        b, bc = baseline_summary(baseline, int(key))
        if b is not None and b.get("stages_ms"):
            bst = b["stages_ms"]
            rows.append([f"/b{bc}", *(
                _fmt_ratio(ratio(st.get(k, {}).get("median", float("nan")),
                                 bst.get(k, {}).get("median", float("nan"))))
                for k in stages)])
    return "per-stage median ms (sum of a stage's spans per request)\n" + _render(rows, header)


def format_first_audio(run: dict[str, Any]) -> str:
    """Where the first audio was made (medians, ms since arrival; server spans), beside the
    client's TTFP: empty when the run has no speech timings."""
    header = ["c", "first token", "Talker chunk 0", "ms", "Code2Wav chunk 0", "ms", "ingress",
              "TTFP"]
    rows = []
    for key in sorted(run["summaries"], key=int):
        s = run["summaries"][key]
        fa = s.get("first_audio_ms") or {}
        if "talker" not in fa:
            continue

        def m(k: str, fa: dict = fa) -> float:
            return fa.get(k, {}).get("median", float("nan"))

        rows.append([key, _fmt(m("first_token"), 1),
                     f"{_fmt(m('talker_start'), 1)} -> {_fmt(m('talker_released'), 1)}",
                     _fmt(m("talker"), 1),
                     f"{_fmt(m('code2wav_start'), 1)} -> {_fmt(m('code2wav_end'), 1)}",
                     _fmt(m("code2wav"), 1), _fmt(m("ingress"), 1),
                     _fmt(s.get("audio_ttfp_ms", {}).get("median"), 1)])
    if not rows:
        return ""
    return ("where the first audio was made (median ms since arrival: server spans; ingress: "
            "when it got that audio; TTFP: client)\n" + _render(rows, header))


def format_accuracy(run: dict[str, Any]) -> str:
    lines = []
    for key in sorted(run["summaries"], key=int):
        s = run["summaries"][key]
        if s.get("accuracy") is None:
            continue
        lines.append(f"c={key}: accuracy {100 * s['accuracy']:.1f}% of {s['graded']}")
        for group, cells in (s.get("accuracy_by") or {}).items():
            parts = [f"{lab} {c}/{n}" for lab, (c, n) in sorted(cells.items())]
            if parts:
                lines.append(f"  by {group}: " + ", ".join(parts))
    return "\n".join(lines)


# The app benchmark's targets (30 s clips): {concurrency: {headline key: (op, bound)}}
APP_TARGETS: dict[int, dict[str, tuple[str, float]]] = {
    1: {"ttft_ms": ("<=", 180.0), "audio_ttfp_ms": ("<=", 250.0), "audio_rtf": ("<=", 0.15),
        "request_throughput": (">=", 3.0)},
    4: {"request_throughput": (">=", 5.0), "audio_throughput": (">=", 11.0),
        "audio_ttfp_ms": ("<=", 450.0)},
}


def check_targets(run: dict[str, Any], targets: dict[int, dict[str, tuple[str, float]]]
                  ) -> list[dict[str, Any]]:
    """One row per target: measured (median / throughput), bound, met, gap = measured/bound - 1."""
    rows = []
    for c, wants in sorted(targets.items()):
        s = run["summaries"].get(str(c))
        h = headline(s) if s else {}
        for key, (op, bound) in wants.items():
            v = h.get(key, float("nan"))
            ok = math.isfinite(v) and (v <= bound if op == "<=" else v >= bound)
            rows.append({"concurrency": c, "metric": key, "op": op, "bound": bound, "value": v,
                         "met": ok, "gap": v / bound - 1 if math.isfinite(v) else float("nan")})
    return rows


def format_targets(run: dict[str, Any],
                   targets: dict[int, dict[str, tuple[str, float]]] = APP_TARGETS) -> str:
    rows = []
    for r in check_targets(run, targets):
        rows.append([f"c={r['concurrency']}", r["metric"], f"{r['op']} {r['bound']:g}",
                     _fmt(r["value"], 3 if r["metric"] == "audio_rtf" else 2),
                     "ok" if r["met"] else ("-" if not math.isfinite(r["value"]) else "MISS"),
                     "-" if not math.isfinite(r["gap"]) else f"{100 * r['gap']:+.0f}%"])
    return "targets (medians; gap = measured / target - 1)\n" + _render(
        rows, ["c", "metric", "target", "measured", "met", "gap"])


def format_report(run: dict[str, Any], baseline: dict[str, Any] | None = None,
                  targets: dict[int, dict[str, tuple[str, float]]] | None = None) -> str:
    parts = [format_table(run, baseline), "", format_stages(run, baseline)]
    first = format_first_audio(run)
    if first:
        parts += ["", first]
    acc = format_accuracy(run)
    if acc:
        parts += ["", acc]
    if targets:
        parts += ["", format_targets(run, targets)]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- plots

_STAGE_COLORS = {
    "queue": "#bbbbbb",
    "preprocess": "#8c564b",
    "vision_encoder": "#1f77b4",
    "audio_encoder": "#17becf",
    "prefill": "#2ca02c",
    "decode": "#98df8a",
    "talker": "#ff7f0e",
    "code2wav": "#d62728",
}


def plot_run(run: dict[str, Any], out_dir: str | os.PathLike, max_timeline: int = 8,
             baseline: dict[str, Any] | None = None) -> list[Path]:
    """Write latency_distributions.png, stage_timeline.png and throughput.png into out_dir.

    Returns the written paths; [] when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _plot_latencies(run, out / "latency_distributions.png", plt),
        _plot_timeline(run, out / "stage_timeline.png", plt, max_timeline),
        _plot_throughput(run, out / "throughput.png", plt, baseline),
    ]
    return paths


def _plot_latencies(run: dict[str, Any], path: Path, plt: Any) -> Path:
    metrics = [("ttft", "TTFT (ms)", 1e3), ("ttfp", "audio TTFP (ms)", 1e3),
               ("e2e", "E2E latency (ms)", 1e3), ("rtf", "audio RTF", 1.0)]
    concs = sorted({rnd["concurrency"] for rnd in run["rounds"]})
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (attr, title, scale) in zip(axes.flat, metrics):
        data, labels = [], []
        for c in concs:
            vals = [getattr(r, attr) for r in run_records(run, c) if r.ok]
            vals = [v * scale for v in vals if v is not None]
            if vals:
                data.append(vals)
                labels.append(f"c={c}")
        if data:
            try:
                ax.boxplot(data, tick_labels=labels, showmeans=True)
            except TypeError:  # matplotlib < 3.9 calls it `labels`
                ax.boxplot(data, labels=labels, showmeans=True)
            for i, vals in enumerate(data, start=1):
                ax.scatter([i] * len(vals), vals, s=6, alpha=0.4)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{run.get('label', 'run')}: latency distributions (measured rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_timeline(run: dict[str, Any], path: Path, plt: Any, max_requests: int) -> Path:
    """Gantt chart of the first requests of the first measured round of each concurrency.

    Server spans are placed at (client send time + span start): the server's clock starts when
    the request arrived, which is the send time up to the network hop.
    """
    rounds = [r for r in run["rounds"] if not r["warmup"]]
    picked: list[tuple[str, dict[str, Any]]] = []
    seen: set[int] = set()
    per_c = max(1, max_requests // max(1, len({r["concurrency"] for r in rounds})))
    for rnd in rounds:
        if rnd["concurrency"] in seen:
            continue
        seen.add(rnd["concurrency"])
        for d in rnd["requests"][:per_c]:
            picked.append((f"c={rnd['concurrency']} #{len(picked)}", d))
    fig, ax = plt.subplots(figsize=(12, 0.55 * max(4, len(picked)) + 1.5))
    used: set[str] = set()
    for y, (name, d) in enumerate(picked):
        t_send = d["t_send"] or 0.0
        if d.get("t_end") is not None:
            ax.plot([t_send, d["t_end"]], [y, y], color="black", lw=0.8, alpha=0.5)
        for sp in ((d.get("timings") or {}).get("spans") or []):
            try:
                x0, x1 = t_send + float(sp["start"]), t_send + float(sp["end"])
            except (KeyError, TypeError, ValueError):
                continue
            st = sp.get("stage", "?")
            ax.barh(y, max(x1 - x0, 1e-4), left=x0, height=0.6,
                    color=_STAGE_COLORS.get(st, "#9467bd"),
                    label=None if st in used else st, edgecolor="none")
            used.add(st)
        if d.get("t_first_text") is not None:
            ax.plot([d["t_first_text"]], [y], marker="|", ms=14, color="green",
                    label=None if "first text" in used else "first text")
            used.add("first text")
        for t, _sec in d.get("audio_events") or []:
            ax.plot([t], [y + 0.35], marker="v", ms=5, color="red",
                    label=None if "audio chunk" in used else "audio chunk")
            used.add("audio chunk")
    ax.set_yticks(range(len(picked)))
    ax.set_yticklabels([n for n, _ in picked])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since round start")
    ax.set_title(f"{run.get('label', 'run')}: per-stage timeline (server spans; client events)")
    if used:
        ax.legend(loc="lower right", fontsize=8, ncol=2)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_throughput(run: dict[str, Any], path: Path, plt: Any,
                     baseline: dict[str, Any] | None) -> Path:
    keys = sorted(run["summaries"], key=int)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (k, title) in zip(axes, [("request_throughput", "requests / s"),
                                     ("audio_throughput", "audio seconds / s")]):
        xs = list(range(len(keys)))
        ax.bar(xs, [run["summaries"][c][k] for c in keys], width=0.4, label=run.get("label"))
        if baseline is not None:
            bvals = [baseline_summary(baseline, int(c))[0] for c in keys]
            ax.bar([x + 0.4 for x in xs], [b[k] if b else 0 for b in bvals], width=0.4,
                   label=f"baseline {baseline.get('label', '')}")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"c={c}" for c in keys])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
