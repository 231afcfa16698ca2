"""Checks the cost model against reality: Spearman rank correlation of estimates and interleaved measurements.

For each model, random rewrite sequences (seeded; each step a random match from `find_matches`) give a set of
distinct graphs; each is estimated with the cost model and measured end to end interleaved against the original
(`compare`, 1 thread by default).  A graph's measured latency is the original's median latency divided by its
interleaved speedup ratio, so drift between comparisons cancels.

    rlflow costmodel check resnet-18-tiny models/bert-base.onnx --out docs/results/costmodel.json

Results are merged by model into the JSON file (written atomically) and summarised in a markdown table next to it.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.ranks import spearman
from rlflow.measure.session import SessionSettings, resolve_provider
from rlflow.measure.timing import compare

MEMORY_BUDGET = 2_000_000_000
"""Bytes of model weights that one interleaved comparison may hold in sessions at once."""


def resolve_model(spec: str) -> tuple[str, Path]:
    """(name, path) for a model file or a zoo name (taken from the repository's models/ folder, else built)."""
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        return path.stem, path
    from rlflow import zoo

    for folder in (zoo.MODELS_DIR, zoo.default_cache_dir()):
        candidate = Path(folder) / f"{spec}.onnx"
        if candidate.exists():
            return spec, candidate
    return spec, Path(zoo.build(spec, zoo.default_cache_dir()).path)


def random_graphs(graph, sequences: int, length: int, rng: np.random.Generator,
                  everywhere: bool = False, rules=None) -> list[tuple[list[str], object]]:
    """The original plus up to `sequences` distinct graphs, each from a random rewrite sequence of length 1..length.

    With `everywhere`, a step is a random matching rule applied wherever it matches (`apply_all`): on a transformer
    one rewrite changes its time by less than a measurement separates, a rule applied to every layer by several percent.
    `rules`: the rules drawn from (default all; `rule_subset`).
    """
    from rlflow.rewrites import RULES, RewriteError, apply, apply_all, find_matches

    rules = RULES if rules is None else rules

    found = [([], graph)]
    seen = {graph.fingerprint()}
    for _ in range(sequences):
        steps = int(rng.integers(1, length + 1))
        current, applied = graph, []
        for _ in range(steps):
            matches = find_matches(current, rules)
            if not matches:
                break
            match = matches[int(rng.integers(len(matches)))]
            if everywhere:
                current, done = apply_all(current, [m for m in matches if m.rule == match.rule])
                applied += [str(m) for m in done]
                continue
            try:
                current = apply(current, match)
            except RewriteError:
                continue
            applied.append(str(match))
        fingerprint = current.fingerprint()
        if applied and fingerprint not in seen:
            seen.add(fingerprint)
            found.append((applied, current))
    return found


def drawn_graphs(name: str, graph, sequences: int, length: int, seed: int, everywhere: bool = False,
                 rules=None) -> list[tuple[list[str], object]]:
    """`random_graphs` of model `name` as the check draws them (one stream per model and seed), so that
    `rlflow.measure.costmodel.audit` audits, and refreshes, the very graphs a check ranks."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return random_graphs(graph, sequences, length, rng, everywhere, rules)


def rule_subset(spec: str | None):
    """The rules a `--rules` value names: a group of `rlflow.rewrites.GROUPS` or comma-separated rule names (None:
    every rule).

    Raises:
        InputError: a name that is neither a group nor a rule.
    """
    from rlflow.errors import InputError
    from rlflow.rewrites import GROUPS, RULES, rule

    if not spec:
        return RULES
    if spec in GROUPS:
        return GROUPS[spec]
    try:
        return tuple(rule(name.strip()) for name in spec.split(",") if name.strip())
    except KeyError as exc:
        raise InputError(f"--rules: {exc.args[0]}; give a group ({', '.join(GROUPS)}) or rule names") from None


def runnable(graphs: list[tuple[list[str], object]], settings: SessionSettings) -> tuple[list, list[dict]]:
    """The graphs onnxruntime can build and run on the settings' provider, and the sequences of those it refuses.

    A rewrite can produce a graph a provider cannot take although the input runs (on CUDA, onnxruntime 1.31 fuses a
    Conv and a Clip into a kernel that then refuses "Clip"); such a graph cannot be measured, so it is left out of the
    check and listed.  The original (first) must run.
    """
    from rlflow.errors import ProviderError
    from rlflow.measure.timing import Pace, probe

    kept, refused = [graphs[0]], []
    for sequence, graph in graphs[1:]:
        try:
            probe(graph.to_model(static=True), settings, Pace())
        except ProviderError as exc:
            refused.append({"sequence": sequence, "error": str(exc)})
            continue
        kept.append((sequence, graph))
    return kept, refused


def check_model(spec: str, cost_model: CostModel, settings: SessionSettings, *, sequences: int, length: int,
                seed: int, rounds: int, repeats: int = 2, everywhere: bool = False, rules=None) -> dict:
    """Estimates and measures the random-rewrite graphs of one model; returns its result record."""
    from tqdm import tqdm

    from rlflow.graph.core import load

    started = time.perf_counter()
    name, path = resolve_model(spec)
    graph = load(path)
    graphs, refused = runnable(drawn_graphs(name, graph, sequences, length, seed, everywhere, rules), settings)

    before = cost_model.stats.as_dict()
    cold = time.perf_counter()
    estimates = [cost_model.graph_cost(g) for _, g in graphs]
    cold = time.perf_counter() - cold
    warm = time.perf_counter()
    for _, g in graphs:
        cost_model.graph_cost(g)
    warm = (time.perf_counter() - warm) / len(graphs)
    after = cost_model.stats.as_dict()
    cost_model.save()

    # Models are exported per comparison and dropped after it: a dozen BERT-sized protos do not fit in memory at once.
    original = graphs[0][1].to_model(static=True)
    count = len(graphs)
    chunk = max(1, min(count - 1, MEMORY_BUDGET // max(original.ByteSize(), 1) - 1)) if count > 1 else 1
    runs = []  # per repeat: speedup (median, low, high) of every graph over the original
    base_ms = []
    bar = tqdm(total=(count - 1) * repeats, desc=name, unit="graph", file=sys.stderr, leave=False)
    for rep in range(repeats):
        ratios = [(1.0, 1.0, 1.0)] + [None] * (count - 1)
        for start in range(1, count, chunk):
            ids = list(range(start, min(start + chunk, count)))
            batch = [original] + [graphs[i][1].to_model(static=True) for i in ids]
            result = compare(batch, settings, rounds=rounds, seed=seed + rep)
            del batch
            base_ms.append(result.timings[0].median_ms)
            for k, i in enumerate(ids, start=1):
                r = result.ratios[k]
                ratios[i] = (r.median, r.low, r.high)
            bar.update(len(ids))
        runs.append(ratios)
    bar.close()
    if not base_ms:  # no rewrite applied: time the original alone
        from rlflow.measure.timing import time_model

        base_ms.append(time_model(original, settings, repeats=rounds).median_ms)
    base = float(np.median(base_ms))
    # Repeats combine as the geometric mean of the medians; the interval is the union of the repeats' intervals.
    ratios = [(float(np.exp(np.mean([np.log(run[i][0]) for run in runs]))), min(run[i][1] for run in runs),
               max(run[i][2] for run in runs)) for i in range(count)]
    measured = [base / r[0] for r in ratios]
    rho = spearman(estimates, measured)
    retest = spearman([r[0] for r in runs[0]], [r[0] for r in runs[1]]) if len(runs) > 1 else float("nan")
    records = [{
        "sequence": seq, "nodes": len(g), "estimate_ms": est, "measured_ms": meas,
        "speedup": r[0], "speedup_low": r[1], "speedup_high": r[2],
    } for (seq, g), est, meas, r in zip(graphs, estimates, measured, ratios)]
    significant = sum(1 for r in ratios[1:] if r[1] > 1.0 or r[2] < 1.0)
    pairs, agree = significant_pairs(estimates, ratios)
    return {
        "model": name,
        "path": str(path),
        "nodes": len(graph),
        "graphs": len(graphs),
        "refused": refused,
        "spearman": None if math.isnan(rho) else rho,
        "retest_spearman": None if math.isnan(retest) else retest,
        "significant_pairs": pairs,
        "significant_pair_agreement": agree,
        "distinct_estimates": len({round(e, 9) for e in estimates}),
        "significant_differences": significant,
        "measured_speedup_range": [min(r[0] for r in ratios), max(r[0] for r in ratios)],
        "original_measured_ms": base,
        "original_estimate_ms": estimates[0],
        "estimate_seconds_cold": cold,
        "graph_cost_ms_warm": warm * 1e3,
        "table_misses": after["misses"] - before["misses"],
        "table_measured": after["measured"] - before["measured"],
        "seconds": time.perf_counter() - started,
        "graphs_detail": records,
    }


def significant_pairs(estimates: list[float], ratios: list[tuple[float, float, float]]) -> tuple[int, float | None]:
    """Pairs of graphs whose measured speedup intervals are disjoint, and the share the estimates order the same way.

    A tie in the estimates counts one half.  Unlike Spearman over all graphs, this ignores pairs that measurement
    cannot tell apart, so it stays meaningful when most rewrites do not change the runtime.
    """
    pairs, agree = 0, 0.0
    for i in range(len(ratios)):
        for j in range(i + 1, len(ratios)):
            if ratios[i][1] > ratios[j][2]:
                faster, slower = i, j
            elif ratios[j][1] > ratios[i][2]:
                faster, slower = j, i
            else:
                continue
            pairs += 1
            agree += 1.0 if estimates[faster] < estimates[slower] else 0.5 if estimates[faster] == estimates[slower] else 0.0
    return pairs, (agree / pairs if pairs else None)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def markdown(report: dict) -> str:
    """A short table of the per-model results."""
    lines = [
        "# Cost model vs end-to-end measurement",
        "",
        f"Settings: {report['settings']}; machine: {report['machine']}; onnxruntime {report['onnxruntime']}.",
        "Spearman rank correlation between cost-model estimates and interleaved measurements over random rewrite",
        "sequences (the original included). *Significant* counts graphs whose measured speedup interval excludes 1;",
        "with few of them the measured ranking is mostly noise and the correlation says little. *Significant pairs*",
        "are pairs of graphs whose measured intervals are disjoint; the share the estimates order the same way",
        "(ties count one half) is the noise-free part of the check. *Retest Spearman* ranks the graphs by two",
        "independent measurement repeats against each other: the ceiling that any estimate can reach. *Refused*: rewritten",
        "graphs onnxruntime would not build or run on the provider, left out of the check.",
        "",
        "| model | rewrites | graphs | refused | Spearman | retest Spearman | distinct estimates | significant | significant pairs ordered right | "
        "measured speedup range | estimate / measured ms (original) | warm graph_cost (ms) | time (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name in sorted(report["models"]):
        r = report["models"][name]
        rho = "n/a" if r["spearman"] is None else f"{r['spearman']:.3f}"
        retest = "n/a" if r.get("retest_spearman") is None else f"{r['retest_spearman']:.3f}"
        low, high = r["measured_speedup_range"]
        agree = "n/a" if r["significant_pair_agreement"] is None else \
            f"{r['significant_pair_agreement']:.2f} of {r['significant_pairs']}"
        drawn = f"{r.get('rules', 'all')} rules{', everywhere' if r.get('everywhere') else ''}"
        lines.append(
            f"| {name} | {drawn} | {r['graphs']} | {len(r.get('refused', []))} | {rho} | {retest} | {r['distinct_estimates']} | {r['significant_differences']} | {agree} | "
            f"{low:.3f}-{high:.3f} | {r['original_estimate_ms']:.3f} / {r['original_measured_ms']:.3f} | "
            f"{r['graph_cost_ms_warm']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def check_models(models, out: str | os.PathLike = "docs/results/costmodel.json", sequences: int = 12, length: int = 6,
                 seed: int = 0, rounds: int = 20, repeats: int = 2, everywhere: bool = False, rules: str | None = None,
                 provider: str = "cpu", threads: int = 1, cache_dir: str | os.PathLike | None = None) -> dict:
    """`rlflow costmodel check`: `check_model` on each of `models` (ONNX files or zoo names) with the rewrites drawn
    from `rules` (a rule group or comma-separated rule names; None: all), merged by model into the JSON report `out`
    (kept where its settings and machine are these) and its markdown page beside it, after every model; returns the
    report."""
    import onnxruntime as ort

    subset = rule_subset(rules)  # an unknown group or rule is an RlflowError before any work
    settings = SessionSettings(provider=resolve_provider(provider), threads=threads)
    cost_model = CostModel(settings, cache_dir=cache_dir)
    out = Path(out)
    try:
        report = json.loads(out.read_text())
        if report.get("settings") != settings.as_dict() or report.get("machine") != cost_model.key["machine"]:
            report = None
    except (OSError, ValueError):
        report = None
    report = report or {"models": {}}
    report.update(settings=settings.as_dict(), machine=cost_model.key["machine"], onnxruntime=ort.__version__,
                  cost_table=str(cost_model.path))
    for spec in models:
        result = check_model(spec, cost_model, settings, sequences=sequences, length=length, seed=seed,
                             rounds=rounds, repeats=repeats, everywhere=everywhere, rules=subset)
        result.update(sequences=sequences, length=length, seed=seed, rounds=rounds, repeats=repeats,
                      everywhere=everywhere, rules=rules or "all")
        report["models"][result["model"]] = result
        rho = "n/a" if result["spearman"] is None else f"{result['spearman']:.3f}"
        print(f"{result['model']}: spearman {rho} over {result['graphs']} graphs "
              f"({result['significant_differences']} significantly different), {result['seconds']:.0f} s", flush=True)
        write_atomic(out, json.dumps(report, indent=1, sort_keys=True) + "\n")
        write_atomic(out.with_suffix(".md"), markdown(report))
    cost_model.save()
    return report
