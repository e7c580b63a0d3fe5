"""A run's report: its curves as PNG plots and one self-contained HTML page (`write`), which the end of training and
`sft report RUN_DIR [RUN_DIR ...]` (`sft.tools.report`, the command) both write.

Reads `metrics.jsonl` (what `sft.run.metrics.MetricsLog` wrote: one line per training log, eval log and the final
summary) and `metrics.discarded.jsonl` (steps an interrupted attempt logged after its last checkpoint, moved aside on
the resume; drawn faintly), `sft_run.json` (the run's settings, `sft.core.outputs`) and `data_stats.json` (the
training data's token lengths, `sft.data.stats`: a histogram). Resume points (the
`resumed_from_step` lines) are marked on every plot. Each plot is a quantity against the optimizer step, every run
on the same axes; the loss plot has the tokens trained on a second axis. `plotted.json` beside the PNGs holds the
values each plot shows. The page's header has each run's settings
and its totals (steps, tokens, FLOPs, wall time; the resumes, out-of-memory retries, skipped non-finite steps and
why a run stopped, from `sft.run.failsafe`'s lines). At the end of training the main process writes the report into the
run directory (`report: false` turns it off).
"""

from __future__ import annotations

import base64
import html
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from sft.errors import ConfigError

logger = logging.getLogger(__name__)

REPORT_DIR = "report"
GENERATOR = '<meta name="generator" content="sft report">'  # what marks a page as sft's own (safe to replace)
# (file stem, title, y label, metrics.jsonl keys drawn; the first key is the plot's main line)
PLOTS = (
    ("loss", "Loss", "loss", ("loss", "eval_loss")),
    ("learning_rate", "Learning rate", "learning rate", ("learning_rate",)),
    ("grad_norm", "Gradient norm (before clipping)", "grad norm", ("grad_norm",)),
    ("tokens_per_second", "Throughput", "tokens/s per GPU", ("tokens_per_second_per_gpu",)),
    ("mfu", "Model FLOPs utilisation (of the bf16 peak)", "MFU", ("mfu",)),
    ("memory", "Peak GPU memory", "GiB", ("peak_memory_gib",)),
    ("packing", "Packing efficiency (real tokens / row capacity)", "efficiency", ("packing_efficiency",)),
)
LABELS = {"loss": "train", "eval_loss": "eval"}


@dataclass
class Run:
    """One run directory's logs."""

    path: Path
    name: str
    lines: list[dict]
    discarded: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)  # data_stats.json (`sft.data.stats`), when training wrote one

    def series(self, key: str, lines: list[dict] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` over the logs that have it (the final summary line has none of these keys)."""
        rows = [r for r in (self.lines if lines is None else lines) if isinstance(r.get(key), (int, float))]
        return [r["step"] for r in rows], [float(r[key]) for r in rows]

    @property
    def resumes(self) -> list[int]:
        return [r["resumed_from_step"] for r in self.lines if "resumed_from_step" in r]

    def totals(self) -> dict[str, str]:
        logs = [r for r in self.lines if "loss" in r]
        summary = next((r for r in reversed(self.lines) if "train_runtime" in r), {})
        last = logs[-1] if logs else {}
        wall = summary.get("train_runtime")
        if wall is None and len(logs) > 1:
            wall = logs[-1]["time"] - logs[0]["time"]
        totals = {"steps": f"{last.get('step', 0):,}"}
        if "num_tokens" in last:
            totals["tokens"] = f"{last['num_tokens']:,.0f}"
        if "num_flops" in last:
            totals["FLOPs"] = f"{last['num_flops']:.3g}"
        if wall is not None:
            totals["wall time"] = f"{wall / 60:.1f} min" if wall >= 60 else f"{wall:.1f} s"
        if logs:
            totals["loss"] = f"{logs[0]['loss']:.4g} -> {logs[-1]['loss']:.4g}"
        evals = [r["eval_loss"] for r in self.lines if "eval_loss" in r]
        if evals:
            totals["eval loss"] = f"{evals[-1]:.4g}"
        if self.resumes:
            totals["resumed at step"] = ", ".join(str(s) for s in self.resumes)
        retries = [r for r in self.lines if "out_of_memory_retry" in r]  # sft.run.failsafe's events
        if retries:
            totals["out-of-memory retries"] = ", ".join(
                f"from step {r['step']} at micro batch {r['out_of_memory_retry']['micro_batch']}" for r in retries
            )
        skipped = [str(r["step"]) for r in self.lines if "nonfinite_skipped" in r]
        if skipped:
            totals["non-finite steps skipped"] = ", ".join(skipped)
        stopped = self.manifest.get("stopped")
        if stopped and self.manifest.get("finished_step") is None:
            totals["stopped"] = f"at step {stopped['step']}: {stopped['reason']} ({stopped['time']})"
        return totals

    def settings(self) -> dict[str, str]:
        fp = self.manifest.get("fingerprint") or {}
        if not fp:
            return {}
        packing = fp.get("packing") or {}
        out = {
            "model": str(fp.get("model")),
            "data": ", ".join(str(s.get("path")) for s in (fp.get("data") or {}).get("sources", [])),
            "processes": f"{fp.get('world_size')} (data parallel {fp.get('parallel', {}).get('dp')}, sequence "
            f"parallel {fp.get('parallel', {}).get('sp')})",
            "global batch (rows)": str(fp.get("global_batch", "")),
            "max length": str(packing.get("max_length")),
            "packing": str(packing.get("packing")),
            "FP8": str(fp.get("fp8")),
            "seed": str(fp.get("seed")),
        }
        return {k: v for k, v in out.items() if v not in ("", "None")}


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: line {number} is not JSON ({e.msg}); was the file cut short?") from e
    return rows


def load_run(path: str | Path) -> Run:
    from sft.core.outputs import DISCARDED_METRICS_FILE, METRICS_FILE, STATS_FILE, read_manifest

    run = Path(path)
    metrics = run / METRICS_FILE
    if not run.is_dir():
        raise ConfigError(f"`{path}`: no such run directory. Give the output_dir of an sft run (e.g. outputs/demo).")
    if not metrics.is_file():
        raise ConfigError(
            f"`{path}` has no {METRICS_FILE}: not an sft run directory, or one that has not logged a step yet (sft "
            "writes it as it trains, every `logging_steps`)."
        )
    lines = _read_jsonl(metrics)
    if not any("loss" in r for r in lines):
        raise ConfigError(f"{metrics}: no training log yet (no line with a loss); nothing to plot.")
    discarded = run / DISCARDED_METRICS_FILE
    stats = run / STATS_FILE
    return Run(
        run,
        run.resolve().name,
        lines,
        _read_jsonl(discarded) if discarded.is_file() else [],
        read_manifest(run) or {},
        json.loads(stats.read_text()) if stats.is_file() else {},
    )


def plot_lengths(runs: list[Run], out: Path):
    """Records by tokens per record (the training data's histogram from data_stats.json), max_length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_data = [r for r in runs if r.data.get("length_histogram")]
    if not with_data:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for run in with_data:
        h = run.data["length_histogram"]
        label = run.name if len(runs) > 1 else f"{run.data['records']:,} records"
        ax.stairs(h["counts"], h["edges"], fill=len(with_data) == 1, alpha=0.6, label=label)
        if run.data.get("max_length") and run.data["max_length"] <= h["edges"][-1] * 1.5:
            ax.axvline(run.data["max_length"], color="red", linestyle="--", linewidth=1, label="max_length")
    ax.set_title("Training data: records by tokens per record", loc="left", fontsize=11)
    ax.set_xlabel("tokens per record (before truncation)")
    ax.set_ylabel("records")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "lengths.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, {run.name: [run.data["length_histogram"]["edges"], run.data["length_histogram"]["counts"]]
                  for run in with_data}  # fmt: skip


def drawn(ax) -> dict[str, list[list[float]]]:
    """What an axes shows: each labelled line's x and y values (`plotted.json`, which the tests compare with the
    logs), and the resume marks."""
    lines = {line.get_label(): [[float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]]
             for line in ax.get_lines() if not line.get_label().startswith("_")}  # fmt: skip
    marks = [float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_label() == "_resume"]
    return lines | ({"resumed at": [marks, []]} if marks else {})


def plot(runs: list[Run], stem: str, title: str, ylabel: str, keys: tuple[str, ...], out: Path):
    """One PNG: `keys` of every run against the step; (its path, what it shows), or None when no run logged any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not any(run.series(key)[0] for run in runs for key in keys):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for j, key in enumerate(keys):
            steps, values = run.series(key)
            if not steps:
                continue
            label = run.name if len(keys) == 1 else f"{run.name}: {LABELS.get(key, key)}"
            if len(runs) == 1 and len(keys) > 1:
                label = LABELS.get(key, key)
            style = {"linestyle": "-" if j == 0 else "--", "marker": "o" if len(steps) < 30 or j else None}
            ax.plot(steps, values, color=color, linewidth=1.4, markersize=3, label=label, **style)
            gone_steps, gone = run.series(key, run.discarded)
            if gone_steps:
                ax.plot(gone_steps, gone, color=color, alpha=0.3, linestyle=":", label=f"{label} (discarded attempt)")
        for step in run.resumes:
            ax.axvline(step, color=color, linestyle="--", alpha=0.6, linewidth=1, label="_resume")
            ax.annotate(f"resumed at {step}", (step, 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8, color=color)  # fmt: skip
    if stem == "loss" and len(runs) == 1:  # tokens trained on a second axis, mapped through the run's own logs
        steps, tokens = runs[0].series("num_tokens")
        if len(steps) > 1 and tokens[-1] > tokens[0]:
            # step 0 had 0 tokens; past the last log, the run's mean tokens per step (keeps the map one-to-one)
            rate = tokens[-1] / steps[-1]
            xs, ys = [0, *steps, steps[-1] * 10], [0.0, *tokens, tokens[-1] + rate * steps[-1] * 9]
            top = ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, xs, ys), lambda t: np.interp(t, ys, xs)))
            top.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))
            top.set_xlabel("tokens trained")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(title, pad=8 if stem != "loss" else 4, loc="left", fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if stem in ("tokens_per_second", "mfu", "memory", "packing"):  # rates and sizes from 0: swings read true
        ax.set_ylim(bottom=0)
    if stem == "mfu":
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    shown = drawn(ax)
    plt.close(fig)
    return path, shown


def _table(rows: dict[str, dict[str, str]]) -> str:
    keys = list(dict.fromkeys(k for values in rows.values() for k in values))
    head = "".join(f"<th>{html.escape(name)}</th>" for name in rows)
    body = "".join(
        f"<tr><th>{html.escape(k)}</th>"
        + "".join(f"<td>{html.escape(v.get(k, ''))}</td>" for v in rows.values())
        + "</tr>"
        for k in keys
    )
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def write(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Plot every run in `run_dirs` into `out` (default: the first run's `report/`); the HTML page's path."""
    runs = [load_run(d) for d in run_dirs]
    if len({r.name for r in runs}) < len(runs):  # e.g. two runs' dirs both named `out`: name them by their parents
        for r in runs:
            r.name = "/".join(r.path.resolve().parts[-2:])
    out = Path(out) if out else runs[0].path / REPORT_DIR
    page = out / "index.html"
    if page.exists() and GENERATOR not in page.read_text(errors="replace"):
        raise ConfigError(f"{page} exists and sft did not write it: give another --out (nothing was changed).")
    out.mkdir(parents=True, exist_ok=True)
    made = [(title, plot(runs, stem, title, ylabel, keys, out)) for stem, title, ylabel, keys in PLOTS]
    made.append(("Training data: records by tokens per record", plot_lengths(runs, out)))
    made = [(title, result) for title, result in made if result is not None]
    for stem in [*(p[0] for p in PLOTS), "lengths"]:  # a plot of an earlier report that this one has not
        stale = out / f"{stem}.png"
        if stale.exists() and all(path != stale for _, (path, _) in made):
            stale.unlink()
    (out / "plotted.json").write_text(json.dumps({path.stem: shown for _, (path, shown) in made}) + "\n")
    made = [(title, path) for title, (path, _) in made]
    images = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>{html.escape(path.name)}</figcaption></figure>'
        for title, path in made
    )
    names = ", ".join(r.name for r in runs)
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}figure{margin:1em 0}"
        "img{max-width:100%}figcaption{color:#666;font-size:12px}"
    )
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'>{GENERATOR}<title>sft report: {html.escape(names)}</title>"
        f"<style>{style}</style></head><body><h1>sft report: {html.escape(names)}</h1>"
        f"<h2>Totals</h2>{_table({r.name: r.totals() for r in runs})}"
        f"<h2>Settings</h2>{_table({r.name: r.settings() for r in runs})}"
        f"<h2>Curves</h2>{images}</body></html>\n"
    )
    return page
