"""Each method's graph scored by the cost model of a provider this machine lacks: how the CUDA agent chooses, seen
without a GPU.

    rlflow bench-estimate models/bert-l4-h256-s16-ts.onnx ... --provider cuda [--agent PATH] --out DIR

On a machine without CUDA the CUDA cost model is the shipped table with the estimate fitted to it
(`rlflow.measure.costmodel.gpu_estimate`), and nothing can be measured.  So per model the agent (its rollouts), TASO-style
search and the fuse-everything policy (every fusion wherever it matches, onnxruntime's transformers optimizer's way)
each end on the graph the cost model prices lowest, and the table gives each one's estimated speedup over the input
and its search time.  Beside them: the estimate's own error on architectures held out of its fit, and how much of each
model's groups the device's table holds (the rest is the estimate's).  An estimate is deterministic, so a method
that agrees with it scores well whether or not the device would: these figures say what the estimate can rank, not
what the device runs; measured figures need the GPU (`rlflow bench --provider cuda`).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rlflow.files import write_text_atomic

METHODS = ("agent", "taso", "fuse-everything")


def estimate_model(path: Path, cost_model, rules, agent: Path, time_limit: float, seed: int,
                   methods: tuple[str, ...] = METHODS) -> dict:
    """One model: the input's estimate, each method's (of `methods`) estimated speedup and time, and the table's
    coverage."""
    from rlflow.graph.core import load
    from rlflow.search.agent import AgentConfig, agent_search
    from rlflow.search.candidates import Candidate, all_fusions
    from rlflow.search.taso import TasoConfig, taso
    from rlflow.train.ship import is_held_out

    graph = load(path)
    settings = cost_model.settings
    base = cost_model.graph_cost(graph)
    rows = {}
    if "fuse-everything" in methods:
        start = time.monotonic()
        fused = all_fusions(Candidate(graph, (), graph.fingerprint()), rules)
        rows["fuse-everything"] = _row(base, cost_model.graph_cost(fused.graph) if fused else base,
                                       len(fused.applied) if fused else 0, time.monotonic() - start,
                                       "every fusion wherever it matches" if fused else "no fusion matches")
    for name, search, config in (
            ("agent", agent_search, AgentConfig(agent=str(agent), time_limit=time_limit, seed=seed, measure=False)),
            ("taso", taso, TasoConfig(time_limit=time_limit, seed=seed, measure=False))):
        if name in methods:
            result = search(graph, settings, config, rules, cost_model=cost_model)
            rows[name] = _row(base, cost_model.graph_cost(result.graph), len(result.applied), result.seconds,
                              result.stop_reason)
            table = result.cost_table or {}
            rows[name]["groups"] = {k: table.get(k) for k in ("groups", "table", "estimated")}
    return {"model": path.stem, "heldout": is_held_out(path.stem, agent.parent, agent.stem), "nodes": len(graph),
            "input_ms_estimated": base, "methods": rows}


def _row(base: float, cost: float, rewrites: int, seconds: float, why: str) -> dict:
    return {"estimated_speedup": base / cost, "rewrites": rewrites, "seconds": seconds, "stop_reason": why}


def summarize(rows: list[dict]) -> dict:
    """Per method: geometric-mean estimated speedup and mean time, over all models and over the held-out ones."""
    out = {}
    for method in [m for m in METHODS if rows and m in rows[0]["methods"]]:
        for part, chosen in (("all", rows), ("heldout", [r for r in rows if r["heldout"]])):
            if chosen:
                speedups = [r["methods"][method]["estimated_speedup"] for r in chosen]
                out.setdefault(method, {})[part] = {
                    "models": len(chosen), "geomean": math.exp(sum(map(math.log, speedups)) / len(speedups)),
                    "mean_seconds": sum(r["methods"][method]["seconds"] for r in chosen) / len(chosen)}
    return out


def markdown(results: dict) -> str:
    """The results as a page: the settings, the estimate's held-out error, one row per model."""
    held = results["estimate"].get("held_out") or {}
    error = held.get("all") or {}
    lines = ["# Each method's graph scored by the cost model (nothing measured)", "",
             f"Provider {results['provider']}; cost model: {results['cost_model']}. Agent `{results['agent']['path']}` "
             f"(SHA-256 {results['agent']['sha256'][:16]}); search time limit {results['time_limit']:.0f} s; seed "
             f"{results['seed']}.", ""]
    if error:
        lines += [f"The estimate's error on architectures held out of its fit ({', '.join(held.get('models', []))}; "
                  f"{error['entries']} groups): median factor {error['median_factor']:.2f}, "
                  f"{100 * error['within_2x']:.0f}% within 2x, Spearman {error['spearman']:.2f}. A group the table "
                  "holds costs what the device measured; the others are estimated.", ""]
    methods = [m for m in METHODS if m in results["methods"]]
    searched = next((m for m in ("taso", "agent") if m in methods), None)
    lines += [f"| model | held out | groups {searched or 'a search'} priced (table / estimated) | input ms (est.) | "
              + " | ".join(f"{m} (est. speedup, s)" for m in methods) + " |",
              "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in methods) + " |"]
    for r in results["rows"]:
        groups = r["methods"][searched]["groups"] if searched else {}
        cells = [f"{r['methods'][m]['estimated_speedup']:.3f} ({r['methods'][m]['seconds']:.1f})" for m in methods]
        lines.append(f"| {r['model']} | {'yes' if r['heldout'] else ''} | {groups.get('table')} / "
                     f"{groups.get('estimated')} | {r['input_ms_estimated']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| method | models | geomean (est.) | held out: models | geomean (est.) | mean s |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for method, parts in results["summary"].items():
        held_out = parts.get("heldout", {})
        lines.append(f"| {method} | {parts['all']['models']} | {parts['all']['geomean']:.3f} | "
                     f"{held_out.get('models', 0)} | {held_out.get('geomean', float('nan')):.3f} | "
                     f"{parts['all']['mean_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def bench_estimate(models, provider: str = "cuda", agent: str | Path | None = None, time_limit: float = 30.0,
                   methods=METHODS, seed: int = 0, out: str | Path = Path("bench-estimate")) -> dict:
    """`rlflow bench-estimate`: each of `methods` (of `METHODS`) on each of `models` (ONNX files), scored by the cost
    model of `provider`, which this machine must lack; `agent` [default: the one shipped for the provider] plays
    method agent.  Writes results.json and results.md into `out` after every model and returns the results."""
    from rlflow.agents.checkpoint import checkpoint_identity
    from rlflow.errors import InputError
    from rlflow.measure.costmodel.gpu_estimate import EstimatedCostModel, cost_model_for
    from rlflow.measure.costmodel.size_estimate import SHIPPED
    from rlflow.measure.memory import release_freed_memory
    from rlflow.optimize.options import rules_for
    from rlflow.rewrites import RULES
    from rlflow.search.agent import shipped_agent

    methods, models, out = tuple(methods), [Path(m) for m in models], Path(out)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise InputError(f"unknown methods {', '.join(unknown) or '(none given)'}: choose from {', '.join(METHODS)}")
    missing = [str(p) for p in models if not p.is_file()]
    if missing:
        raise InputError(f"no such model file: {', '.join(missing)}")
    cost_model = cost_model_for(provider)
    if not isinstance(cost_model, EstimatedCostModel):
        raise InputError(f"{provider} runs on this machine: measure it with `rlflow bench --provider "
                         f"{provider}` instead of estimating")
    resolved = cost_model.settings.provider
    agent = Path(agent) if agent else shipped_agent(resolved)
    rules = rules_for(RULES, "all", resolved)
    estimate = json.loads(Path(SHIPPED[provider.lower()][1]).read_text())
    results = {"provider": resolved, "cost_model": f"{cost_model.path.name} and {cost_model.estimate.source}",
               "estimate": {"held_out": estimate.get("held_out"), "in_sample": estimate.get("in_sample")},
               "agent": checkpoint_identity(agent), "methods": list(methods), "time_limit": time_limit,
               "seed": seed, "rows": []}
    out.mkdir(parents=True, exist_ok=True)
    for path in models:
        row = estimate_model(path, cost_model, rules, agent, time_limit, seed, methods)
        results["rows"].append(row)
        results["summary"] = summarize(results["rows"])
        print(f"{row['model']:<34} " + "  ".join(f"{m} {row['methods'][m]['estimated_speedup']:.3f}"
                                                 for m in METHODS if m in methods), flush=True)
        write_text_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
        write_text_atomic(out / "results.md", markdown(results))
        release_freed_memory()  # a model's rollouts leave gigabytes freed but scattered (`release_freed_memory`)
    print(f"results in {out}/: results.json, results.md")
    return results

