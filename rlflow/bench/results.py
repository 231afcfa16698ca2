"""What a bench run records and the files it writes: one `Row` per model and method, the per-method summary, and
results.json, results.csv, results.md, speedup.png and time.png, each written atomically so that a run's results
folder can be read while it goes on.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from rlflow.files import write_text_atomic
from rlflow.plots import plot_bench_speedups, plot_bench_times


@dataclass
class Row:
    """One model under one method."""

    model: str
    method: str
    status: str
    error: str = ""
    kind: str = "rlflow"
    params: int = 0
    flops: int = 0
    baseline_ms: float = float("nan")
    latency_ms: float = float("nan")
    speedup: float = float("nan")
    speedup_low: float = float("nan")
    speedup_high: float = float("nan")
    faster: bool = False
    rewritten: bool = False
    verified: bool = False
    max_rel_error: float = float("nan")
    device_error: float = float("nan")  # on CUDA: the output there against the input on the CPU (`device_errors`)
    input_device_error: float = float("nan")  # the input's own, the floor the device's arithmetic sets
    seconds: float = float("nan")
    search_seconds: float = float("nan")
    heldout: bool = False
    gate_speedup: float = float("nan")
    reason: str = ""
    outcome: str = ""
    search_stop: str = ""  # why the method's search ended (a kept rewrite does not say whether it ran out of time)
    candidates_measured: int = 0
    rewrites: list[str] = field(default_factory=list)
    baseline_peak_fraction: float = float("nan")
    peak_fraction: float = float("nan")
    bytes_read: int = 0  # weights, constants and inputs (a decode step's cache): what one run must read at least
    baseline_memory_fraction: float = float("nan")
    memory_fraction: float = float("nan")  # bytes_read / latency over the measured streaming bandwidth
    peer_settings: dict = field(default_factory=dict)  # what a peer ran with (ort-transformers: type, heads, fusions)
    profiles: list[dict] = field(default_factory=list)  # with several profiles: label, weight, speedup, low, high each
    node: str = ""  # the machine it ran on (a Ray run spreads models over several)
    same_output_as: str = ""  # an earlier method that wrote the same graph: measured once, so the same figures
    same_as_run: bool = False  # with same_output_as: the graphs differ, but not once onnxruntime has optimised them


CSV_FIELDS = [f for f in Row.__dataclass_fields__]
"""The columns of results.csv: every field of a `Row`, in order."""


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(rows: Sequence[dict]) -> dict:
    """Per method: geometric-mean speedup and mean times, over all models and over the agent's held-out ones."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        for part, chosen in (("all", [r for r in rows if r["method"] == method and r["status"] == "ok"]),
                             ("heldout", [r for r in rows if r["method"] == method and r["status"] == "ok"
                                          and r.get("heldout")])):
            if chosen:
                out.setdefault(method, {})[part] = {
                    "models": len(chosen),
                    "geomean_speedup": float(np.exp(np.mean(np.log([r["speedup"] for r in chosen])))),
                    "slower": sum(r["speedup_high"] < 1.0 for r in chosen),
                    "below_0.99": sum(r["speedup_low"] < 0.99 for r in chosen),
                    "mean_seconds": float(np.mean([r["seconds"] for r in chosen])),
                    "mean_search_seconds": _mean([r["search_seconds"] for r in chosen if r["kind"] == "rlflow"]),
                }
    return out


def write_results(results: dict, out_dir: Path) -> None:
    """results.json, results.csv, results.md, speedup.png and time.png, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for row in results["rows"]:
        writer.writerow({**row, "rewrites": ";".join(row["rewrites"]),
                         "peer_settings": json.dumps(row["peer_settings"], sort_keys=True) if row.get("peer_settings")
                         else "", "profiles": "; ".join(_profile_text(p) for p in row.get("profiles", []))})
    write_text_atomic(out_dir / "results.csv", buffer.getvalue())
    write_text_atomic(out_dir / "results.md", markdown_table(results))
    plot_results(results, out_dir)


def _profile_text(profile: dict) -> str:
    return (f"{profile['label']} (weight {profile['weight']:g}): {profile['speedup']:.3f} "
            f"[{profile['speedup_low']:.3f}, {profile['speedup_high']:.3f}]")


def markdown_table(results: dict) -> str:
    """The results as a markdown table, with the settings they were measured under."""
    env, cfg, peak = results["environment"], results["config"], results["peak"]
    lines = [
        "# rlflow bench results", "",
        f"Measured {env['date']} on {env['cpu']} ({env['cores']} cores), {env['provider']}"
        f"{', CUDA graph capture' if results['settings'].get('cuda_graph') else ''}, "
        f"{results['settings']['threads']} thread(s), graph optimisation '{results['settings']['opt_level']}', "
        f"onnxruntime {env['onnxruntime']}, onnx {env['onnx']}, rlflow {env['rlflow']}. "
        f"Search time limit {_limit(cfg['time_limit'])} per model and method; {cfg['rounds']} interleaved rounds per "
        f"measurement; seed {cfg['seed']}. Matrix-product peak measured by the bench: {peak['gflops']:.1f} GFLOP/s"
        + (f", streaming bandwidth {peak['gbs']:.1f} GB/s. " if peak.get("gbs") else ". ") +
        f"Before the methods run on a model, the cost table is filled for its graph (outside every method's time; "
        f"{sum(s for s in results.get('cost_table_warmup_seconds', {}).values() if s is not None):.0f} s in all)."
        + (f" Method agent: `{agent['path']}` (SHA-256 {agent['sha256'][:16]})." if (agent := results.get("agent"))
           else ""),
        "",
        "Speedup = input latency / output latency under ORT_ENABLE_ALL, median of interleaved rounds with a 95% "
        "bootstrap interval; **bold** where the interval lies above 1. A rewritten output is measured afresh, apart "
        "from the measurement optimize() chose it by, and the methods' outputs of a model together, in the same "
        "rounds: a graph two methods reached is measured once (`= greedy`: the same graph as greedy's); a kept input "
        "is the input itself (speedup exactly 1). `peak` = "
        "achieved FLOP/s of the output as a fraction of the measured peak; `memory` = the bytes one run must read "
        "(weights, constants, inputs such as a KV cache) per second of the output, as a fraction of the measured "
        "streaming bandwidth (the roof of a memory-bound model such as a decode step). Error = worst relative-norm error of the "
        "output against the input on random inputs.", "",
        *(["Row `control` (`--control`): a copy of the input measured with the methods' outputs as one of them; it "
           "computes the same in the same nodes, so how far its speedup strays from 1 is the measurement's own, "
           "the least difference a figure on that model can show.", ""]
          if any(r["method"] == "control" for r in results["rows"]) else []),
        *([] if results.get("complete", True)
          else ["**Partial results: the run was still going or was interrupted.**", ""]),
        "| model | method | status | input ms | output ms | speedup [95% CI] | peak | memory | error | rewrites "
        "| time s |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        if r["status"] not in ("ok", "wrong output"):
            lines.append(f"| {r['model']} | {r['method']} | {r['status']}: {r['error']} | | | | | | | | |")
            continue
        speed = f"{r['speedup']:.3f} [{r['speedup_low']:.3f}, {r['speedup_high']:.3f}]"
        if r["faster"]:
            speed = f"**{speed}**"
        same = (f" (= {r['same_output_as']}{' as run' if r.get('same_as_run') else ''})" if r.get("same_output_as")
                else "")
        lines.append(f"| {r['model']}{' †' if r.get('heldout') else ''} | {r['method']}{same} | {r['status']} "
                     f"| {r['baseline_ms']:.3f} | {r['latency_ms']:.3f} "
                     f"| {speed} | {r['peak_fraction']:.1%} | {r.get('memory_fraction', float('nan')):.1%} "
                     f"| {r['max_rel_error']:.1e} "
                     f"| {len(r['rewrites']) if r['kind'] == 'rlflow' else r['kind']} "
                     f"| {r['seconds']:.1f} |")
    profiled = [r for r in results["rows"] if r.get("profiles")]
    if cfg.get("profiles"):
        lines += ["", "## Per profile", "",
                  f"Profiles: {', '.join(f'`{p}`' for p in cfg['profiles'])}. A method's speedup above is the weighted "
                  "geometric mean of its speedups at these profiles (and of their bounds), peers' as rlflow's. "
                  "Per profile:", ""]
        lines += [f"- {r['model']} / {r['method']}: " + "; ".join(_profile_text(p) for p in r["profiles"])
                  for r in profiled] or ["- none"]
    if any(r.get("heldout") for r in results["rows"]):
        lines += ["", "† held out: the agent never trained on this architecture "
                      f"({results.get('heldout_from', 'rlflow/checkpoints/default.json')})."]
    lines += ["", "## Per method", "",
              "Geometric-mean speedup; `slower` counts intervals entirely below 1, `< 0.99` intervals reaching below "
              "0.99; time is the whole optimisation (search, verification, final measurement), search time the "
              "search alone.", "",
              "| method | models | geomean speedup | slower | < 0.99 | mean time s | mean search s "
              "| held out: models | geomean | mean search s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, parts in results.get("summary", {}).items():
        a, h = parts.get("all"), parts.get("heldout")
        if a is None:
            continue
        held = (f"{h['models']} | {h['geomean_speedup']:.3f} | {_fmt(h['mean_search_seconds'])}" if h
                else "0 | | ")
        lines.append(f"| {method} | {a['models']} | {a['geomean_speedup']:.3f} | {a['slower']} | {a['below_0.99']} "
                     f"| {a['mean_seconds']:.1f} | {_fmt(a['mean_search_seconds'])} | {held} |")
    return "\n".join(lines + _outcome_lines(results["rows"]) + _device_lines(results["rows"])
                     + _peer_settings_lines(results["rows"])) + "\n"


def _device_lines(rows: Sequence[dict]) -> list[str]:
    """On CUDA: each output's error run on the device against the input on the CPU, beside the input's own."""
    checked = [r for r in rows if np.isfinite(r.get("input_device_error", float("nan")))]
    if not checked:
        return []
    lines = ["", "## On the device", "",
             "Outputs are verified on the CPU; here each output and its input ran on the device, against the input on "
             "the CPU (random inputs, one seed). An output far above its input's error computes something else "
             "there.", "", "| model | method | output's error | input's error |", "| --- | --- | ---: | ---: |"]
    return lines + [f"| {r['model']} | {r['method']} | {r['device_error']:.1e} | {r['input_device_error']:.1e} |"
                    for r in checked]


def outcome(row: dict) -> str:
    """optimize()'s `Result.outcome` for an rlflow row; '' for peers and for rows recorded before it was kept."""
    return (row.get("outcome") or "") if row["kind"] == "rlflow" else ""


def _outcome_lines(rows: Sequence[dict]) -> list[str]:
    """Per method: how many models ended each way, with the gate's median for each rejected rewrite."""
    methods = list(dict.fromkeys(r["method"] for r in rows if outcome(r)))
    if not methods:
        return []
    lines = ["", "## What each search's rewrite came to", "",
             "`gate rejected`: the search's verified rewrite was not measurably faster in optimize()'s final "
             "measurement (its median speedup there in brackets), so the input was kept. `out of time`: the search "
             "kept the input with candidates it would have measured left unmeasured when its time ran out.", "",
             "| method | rewritten | gate rejected | not verified | out of time | nothing found |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for method in methods:
        mine = [r for r in rows if r["method"] == method and outcome(r)]
        count = {kind: sum(outcome(r) == kind for r in mine)
                 for kind in ("rewritten", "not verified", "out of time", "nothing found")}
        rejected = [r for r in mine if outcome(r) == "gate rejected"]
        detail = ", ".join(f"{r['model']} ({r['gate_speedup']:.3f})" for r in rejected)
        lines.append(f"| {method} | {count['rewritten']} | {len(rejected)}{': ' + detail if detail else ''} "
                     f"| {count['not verified']} | {count['out of time']} | {count['nothing found']} |")
    return lines


def _peer_settings_lines(rows: Sequence[dict]) -> list[str]:
    """The settings each configurable peer ran with on each model (onnxruntime's transformers optimizer's model type,
    heads, hidden size and where each came from, and the fused operators it reported)."""
    chosen = [r for r in rows if r.get("peer_settings")]
    if not chosen:
        return []
    lines = ["", "## Peer settings", "",
             "As each peer ran; `source` says where model type, heads and hidden size came from (`zoo`: the zoo "
             "entry's hints, `graph`: read from the graph, `optimizer`: 0 passed, detected by the tool itself); "
             "`fused` counts the fused operators the tool reported in its output.", "",
             "| model | peer | settings |", "| --- | --- | --- |"]
    for r in chosen:
        settings = ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(r["peer_settings"].items()))
        lines.append(f"| {r['model']} | {r['method']} | {settings.replace('|', '/')} |")
    return lines


def _fmt(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.1f}"


def _limit(seconds: float | None) -> str:
    return "each method's default (agent 10 s, searches 60 s)" if seconds is None else f"{seconds:.0f} s"


def plot_results(results: dict, out_dir: Path) -> None:
    """speedup.png (per model and method: median and interval) and time.png (optimisation time), over the rows that
    ran; neither is written when none did."""
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    if not rows:
        return
    models = sorted({r["model"] for r in rows})
    speedups, seconds = {}, {}
    for method in dict.fromkeys(r["method"] for r in rows):
        by_model = {r["model"]: r for r in rows if r["method"] == method}
        speedups[method] = tuple([by_model[m][key] if m in by_model else np.nan for m in models]
                                 for key in ("speedup", "speedup_low", "speedup_high"))
        seconds[method] = [by_model[m]["seconds"] if m in by_model else np.nan for m in models]
    plot_bench_speedups(models, speedups, out_dir / "speedup.png")
    plot_bench_times(models, seconds, out_dir / "time.png")
