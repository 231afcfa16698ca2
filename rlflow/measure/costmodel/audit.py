"""Audits the cost model's table: measures the fusion groups of a model's graphs again and lists the cached costs
that the new measurements do not confirm; with `--refresh`, puts the new measurements in their place.

The table measures each group once, when it first meets it, and keeps that cost for good.  The measurement takes the
fastest of several batches (`rlflow.measure.costmodel.group_timing.time_beyond`), yet on the -tiny models a group costs a few
to a few tens of microseconds, and one measurement of it scatters by about as much. On nasrnn-tiny,
Gemm+Tanh+Add+Sigmoid+Add+Tanh+Mul+Tanh is cached at 0.0331 ms and measures 0.0026, 0.0133 and 0.0109 ms when
measured again. That one entry makes matmul-add-to-gemm pay -36.6% and a later rewrite +37.6%
on graphs whose end-to-end latencies differ by about 1%: a phantom reward, and the kind that decides the world
model's held-out reward Pearson.  That was table version 3; version 4 (`rlflow.measure.costmodel.model.CACHE_VERSION`)
times small groups as many copies at once and scales out the machine's slowdown, and this audit is how it was checked.

The graphs audited are the model itself and the graphs of random rewrite sequences from it, drawn as
`rlflow.measure.costmodel.check` draws them (the same graphs, for the same options).  Without `--refresh` the audit
is read-only: the table stays as it is, because the rewards of the runs already made rest on it.  Run it on an
otherwise idle machine, or the new measurements carry the same noise they are meant to expose.

    rlflow costmodel audit nasrnn-tiny --sequences 30 --length 12 --out build/audit.json
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rlflow.errors import RlflowError
from rlflow.measure.costmodel.model import CostModel

log = logging.getLogger("rlflow")

FACTOR = 2.0
"""A cached cost disagrees when it and the median of the new measurements differ by more than this factor..."""

FLOOR_MS = 0.005
"""...and by more than this many milliseconds (smaller differences are within the timing noise of one group)."""


@dataclass
class GroupAudit:
    """One table entry measured again.

    Attributes:
        key: the table's cost key.
        ops: the group's operators, in order.
        cached_ms: the cost the table holds (None: not measured yet, so nothing to confirm).
        fresh_ms: the new measurements, each as the table would have stored it.
    """

    key: str
    ops: str
    cached_ms: float | None
    fresh_ms: list[float]

    @property
    def fresh_median_ms(self) -> float:
        return float(statistics.median(self.fresh_ms))

    def disagrees(self, factor: float = FACTOR, floor_ms: float = FLOOR_MS) -> bool:
        """Whether the cached cost and the new median differ by more than `factor` and by more than `floor_ms`."""
        if self.cached_ms is None:
            return False
        low, high = sorted((self.cached_ms, self.fresh_median_ms))
        return high - low > floor_ms and high > factor * max(low, 1e-9)


def audit_graphs(cost_model: CostModel, graphs: list, *, repeats: int = 3, progress=None) -> list[GroupAudit]:
    """Every distinct table entry the groups of `graphs` use, with `repeats` new measurements each (table unchanged).

    Args:
        cost_model: whose table is audited.
        graphs: `rlflow.graph.core.Graph` objects.
        repeats: new measurements per entry (their median is compared).
        progress: a tqdm-like object, advanced once per graph.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    audits: dict[str, GroupAudit] = {}
    for graph in graphs:
        for group in cost_model.groups(graph):
            try:
                key = cost_model.cached_key(graph, group)
                if key is None or key in audits:  # never measured (nothing to confirm), or audited already
                    continue
                fresh = cost_model.remeasure(graph, group, repeats)
            except Exception as exc:  # noqa: BLE001 - the cost model counts such a group as 0; so does the audit
                log.warning("audit: cannot measure group at %s (%s); skipped", group.anchor, exc)
                continue
            audits[key] = GroupAudit(key, "+".join(n.op for n in group.members), cost_model.table["costs"][key],
                                     fresh)
        if progress is not None:
            progress.update(1)
    return list(audits.values())


def refresh(cost_model: CostModel, audits: list[GroupAudit]) -> int:
    """Puts each audited entry's new median in the table and saves it; returns how many entries were written.

    The table's entries are meant to be measured on an idle machine; those that training processes wrote while
    another seed trained beside them read 1-4x what the same groups measure alone, unevenly enough to reorder graphs
    (DeiT-tiny's estimates against measurement lost all rank correlation; docs/agents.md).
    Run it on an idle machine, and only between training runs: the rewards of a run rest on the table it read.
    """
    written = 0
    for audit in audits:
        if audit.cached_ms is not None:
            cost_model.set_cost(audit.key, audit.fresh_median_ms)
            written += 1
    cost_model.save()
    return written


def summary(audits: list[GroupAudit], factor: float = FACTOR, floor_ms: float = FLOOR_MS) -> dict:
    """Counts and the disagreeing entries (largest difference first), as the JSON report holds them."""
    cached = [a for a in audits if a.cached_ms is not None]
    bad = sorted((a for a in cached if a.disagrees(factor, floor_ms)),
                 key=lambda a: -abs(a.cached_ms - a.fresh_median_ms))
    # log(cached / new): its sign says which is higher, its size how far apart (ratio: the larger over the smaller)
    logs = np.array([math.log(a.cached_ms / max(a.fresh_median_ms, 1e-9)) for a in cached])
    ratios = np.exp(np.abs(logs))
    return {"cached": len(cached), "disagreeing": len(bad),
            "ratio_median": float(np.median(ratios)) if len(logs) else None,
            "ratio_p90": float(np.percentile(ratios, 90)) if len(logs) else None,
            "cached_over_new_geomean": float(np.exp(logs.mean())) if len(logs) else None,
            "cached_above_new": float(np.mean(logs > 0)) if len(logs) else None,
            "factor": factor, "floor_ms": floor_ms,
            "disagreeing_entries": [{**asdict(a), "fresh_median_ms": a.fresh_median_ms} for a in bad]}


def markdown(report: dict) -> str:
    """The report as a short markdown page: per model the counts, then its largest disagreements."""
    lines = ["# Cost-table audit", "", f"Command: `{report['command']}`", "",
             f"Table: `{report['cost_table']}`; settings: {report['settings']}", "",
             "Ratio: the larger of an entry's cached cost and the median of its new measurements over the smaller; "
             "cached/new: the geometric mean of cached over new, and the share of entries cached higher.", "",
             "| model | graphs | cached entries | disagreeing | ratio median | ratio 90th percentile | cached/new | "
             "cached higher | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for name, result in report["models"].items():
        ratios = " | ".join("-" if result.get(k) is None else f"{result[k]:.2f}"
                            for k in ("ratio_median", "ratio_p90", "cached_over_new_geomean", "cached_above_new"))
        lines.append(f"| {name} | {result['graphs']} | {result['cached']} | {result['disagreeing']} | {ratios} | "
                     f"{result['seconds']:.0f} |")
    for name, result in report["models"].items():
        if result["disagreeing_entries"]:
            lines += ["", f"## {name}: largest disagreements", "", "| cached ms | new ms (each) | operators |",
                      "|---|---|---|"]
            for row in result["disagreeing_entries"][:15]:
                fresh = ", ".join(f"{x:.4f}" for x in row["fresh_ms"])
                lines.append(f"| {row['cached_ms']:.4f} | {fresh} | {row['ops']} |")
    return "\n".join(lines) + "\n"


def audit_models(models, sequences: int = 20, length: int = 10, everywhere: bool = False, repeats: int = 3,
                 refresh_table: bool = False, seed: int = 0, factor: float = FACTOR, floor_ms: float = FLOOR_MS,
                 cache_dir: str | Path | None = None, out: str | Path | None = None,
                 command: str | None = None) -> dict:
    """`rlflow costmodel audit`: audits the table entries of each of `models` (ONNX files or zoo names) over the
    graphs `drawn_graphs` draws, prints what disagrees, with `refresh_table` writes the new medians into the table,
    and writes the report to `out` (JSON, a markdown page beside it) when given; returns the report.  `command` is
    recorded in it [default: the `rlflow costmodel audit` line that does the same].

    Raises:
        RlflowError: a model that cannot be read or a table that cannot be used (nothing is written then).
    """
    from tqdm.auto import tqdm

    from rlflow.graph.core import load
    from rlflow.measure.costmodel.check import drawn_graphs, resolve_model, write_atomic

    if command is None:
        import shlex

        command = shlex.join(["rlflow", "costmodel", "audit", *map(str, models), "--sequences", str(sequences),
                              "--length", str(length), "--repeats", str(repeats), "--seed", str(seed)]
                             + ["--everywhere"] * everywhere + ["--refresh"] * refresh_table)
    try:
        cost_model = CostModel(cache_dir=cache_dir)
        report = {"cost_table": str(cost_model.path), "settings": cost_model.settings.as_dict(), "command": command,
                  "models": {}}
        for spec in models:
            name, path = resolve_model(spec)
            start = time.monotonic()
            graphs = [g for _, g in drawn_graphs(name, load(path), sequences, length, seed, everywhere)]
            with tqdm(total=len(graphs), desc=f"audit {name}", leave=False, file=sys.stderr) as bar:
                audits = audit_graphs(cost_model, graphs, repeats=repeats, progress=bar)
            result = {**summary(audits, factor, floor_ms), "graphs": len(graphs),
                      "seconds": time.monotonic() - start}
            report["models"][name] = result
            print(f"{name}: {result['disagreeing']} of {result['cached']} cached entries disagree with "
                  f"{repeats} new measurements (over {len(graphs)} graphs, {result['seconds']:.0f} s); "
                  f"cached/new ratio median {result['ratio_median'] or 0:.2f}, 90th percentile "
                  f"{result['ratio_p90'] or 0:.2f}; cached over new {result['cached_over_new_geomean'] or 0:.2f}x "
                  f"(geometric mean), {result['cached_above_new'] or 0:.0%} of the entries higher", flush=True)
            for row in result["disagreeing_entries"][:10]:
                print(f"  cached {row['cached_ms']:.4f} ms, now {row['fresh_median_ms']:.4f} ms  {row['ops'][:80]}")
            if refresh_table:
                result["refreshed"] = refresh(cost_model, audits)
                print(f"  refreshed {result['refreshed']} entries in {cost_model.path}", flush=True)
    except (OSError, ValueError) as exc:  # a file that cannot be read, a model onnx refuses: one line, as an input's
        raise RlflowError(str(exc)) from exc
    if out:
        write_atomic(Path(out), json.dumps(report, indent=1) + "\n")
        write_atomic(Path(out).with_suffix(".md"), markdown(report))
    return report
