"""Tables and a plot of the GPU kit's optimize step (`GPU_STEPS=optimize`): per model, `rlflow optimize`'s own verdict
and the captured comparison `gpu/cuda_graph_peer.py --rewritten` made of its output.

Reads DIR/optimize/STEM.json (the optimize report) and DIR/optimize/STEM.captured.json, writes DIR/optimize.md and
DIR/optimize.png:

    python gpu/summarize_optimize.py docs/results/gpu/h200-1126
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from rlflow.files import write_text_atomic


def _interval(ratio: dict) -> str:
    return f"{ratio['median']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"


def _reason(error: str) -> str:
    """onnxruntime's message, shortened to what a table cell can hold."""
    if "not been partitioned to the CUDAExecutionProvider" in error:
        return "capture refused: onnxruntime placed some nodes on the CPU"
    return error.rsplit(" : ", 1)[-1].strip()[:80]


def rows(folder: Path) -> list[dict]:
    """One row per optimize report in `folder/optimize`, with its captured comparison where that ran."""
    out = []
    for report_path in sorted((folder / "optimize").glob("*.json")):
        if report_path.name.endswith(".captured.json"):
            continue
        report = json.loads(report_path.read_text())
        captured_path = report_path.with_name(report_path.stem + ".captured.json")
        captured = json.loads(captured_path.read_text())["rows"][0] if captured_path.exists() else None
        rules = Counter(a.split("@")[0] for a in report["applied"])
        out.append({"model": report_path.stem, "report": report, "captured": captured, "rules": rules})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| model | `rlflow optimize` speedup [95%] | input -> output ms | search s | rewrites | "
             "capture alone | rewrite, plain | rewrite, both captured | both together | max rel. error on CUDA |",
             "|---|---|---|---:|---|---|---|---|---|---:|"]
    for row in table:
        report, captured = row["report"], row["captured"]
        latency = report["latency_ms"]
        rewrites = ", ".join(f"{rule} {n}" for rule, n in row["rules"].most_common())
        if captured and captured["status"] == "ok":
            capture = (f"{captured['speedup']:.2f} [{captured['speedup_low']:.2f}, {captured['speedup_high']:.2f}]",
                       _interval(captured["rewrite_plain"]), _interval(captured["rewrite_captured"]),
                       _interval(captured["both"]), f"{captured['rewritten_max_rel_error']:.1e}")
        else:
            why = _reason(captured["error"]) if captured else "not run"
            capture = (f"n/a: {why}", "", "", "", "")
        lines.append(f"| {row['model']} | {_interval(report['speedup'])} | {latency['before']['median_ms']:.3f} -> "
                     f"{latency['after']['median_ms']:.3f} | {report['seconds']['search']:.1f} | {rewrites} | "
                     + " | ".join(capture) + " |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shown = [r for r in table if r["captured"] and r["captured"]["status"] == "ok"]
    bars = [("rewrite, plain sessions", lambda c: c["rewrite_plain"]),
            ("CUDA graph capture alone", lambda c: {"median": c["speedup"], "low": c["speedup_low"],
                                                    "high": c["speedup_high"]}),
            ("rewrite, both captured (over the captured input)", lambda c: c["rewrite_captured"]),
            ("rewrite and capture", lambda c: c["both"])]
    x = np.arange(len(shown))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(shown)), 4))
    for i, (label, pick) in enumerate(bars):
        ratios = [pick(r["captured"]) for r in shown]
        medians = np.array([q["median"] for q in ratios])
        errors = np.array([[m - q["low"] for m, q in zip(medians, ratios)],
                           [q["high"] - m for m, q in zip(medians, ratios)]])
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, medians, width, yerr=errors, capsize=2, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, [r["model"] for r in shown], rotation=30, ha="right")
    ax.set_ylabel("speedup (x) over the plain CUDA session")
    ax.set_title(f"rlflow optimize --method greedy on CUDA, batch 1 ({device})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python gpu/summarize_optimize.py", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a results folder holding optimize/ (and environment.json)")
    args = parser.parse_args(argv)
    table = rows(args.folder)
    if not table:
        print(f"error: {args.folder / 'optimize'}: no optimize reports", file=sys.stderr)
        return 2
    environment = args.folder / "environment.json"
    device = json.loads(environment.read_text())["device"] if environment.exists() else "CUDA"
    write_text_atomic(args.folder / "optimize.md", markdown(table))
    plot(table, args.folder / "optimize.png", device)
    print(f"wrote {args.folder / 'optimize.md'} and {args.folder / 'optimize.png'} ({len(table)} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
