"""Speed of the rule library on a graph of 1,000+ nodes: `find_matches` over every rule, and one `apply`.

    rlflow bench-rules [--models bert-base,gpt2-small,resnet-50] [--out docs/results/rules-speed.json]

The graph is the named zoo models side by side in one graph (names prefixed, inputs and outputs kept), read from
``models/<name>.onnx`` (``rlflow zoo build <name> --out models/``) or built into a temporary folder when absent.  It
times `find_matches` (median of `--repeats` runs) and `apply` on up to `--applies` different matches spread over every
rule that matches (each applied once after a warm-up), splits `apply` into its steps (clone, re-check, rewrite,
finish_edit, and finish_edit's cleanup / toposort / shape inference), prints a table and writes the figures as JSON.
`--profile` adds the functions where `apply` spends its time (cProfile).  Targets: find_matches < 1 s, apply < 50 ms.
"""
from __future__ import annotations

import cProfile
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

from rlflow.graph import shape_inference as shapes
from rlflow.graph.core import Graph
from rlflow.rewrites import RULES, apply, find_matches
from rlflow.rewrites.base import Match, Rule

DEFAULT_MODELS = ("bert-base", "gpt2-small", "resnet-50")
FIND_TARGET_S, APPLY_TARGET_S = 1.0, 0.050


def _model_path(name: str, models_dir: Path, scratch: Path) -> Path:
    path = models_dir / f"{name}.onnx"
    if path.exists():
        return path
    from rlflow import zoo

    print(f"{path} is absent: building {name} into {scratch} (rlflow zoo build {name} --out models/ keeps it)",
          file=sys.stderr)
    return Path(zoo.build(name, scratch).path)


def stacked_graph(names, models_dir: Path) -> Graph:
    """The named zoo models side by side in one Graph (each model's names prefixed with its index)."""
    with tempfile.TemporaryDirectory() as scratch:
        protos = []
        for i, name in enumerate(names):
            proto = onnx.load(str(_model_path(name, models_dir, Path(scratch))))
            protos.append(onnx.compose.add_prefix(proto, f"m{i}_") if len(names) > 1 else proto)
    first = protos[0]
    graph = onnx.helper.make_graph(
        [n for p in protos for n in p.graph.node], "+".join(names),
        [i for p in protos for i in p.graph.input], [o for p in protos for o in p.graph.output],
        initializer=[t for p in protos for t in p.graph.initializer],
        value_info=[v for p in protos for v in p.graph.value_info])
    opsets = {}
    for p in protos:
        for o in p.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
                                   ir_version=first.ir_version)
    del protos
    return Graph.from_model(model)


def _spread(matches: list[Match], count: int) -> list[Match]:
    """Up to `count` matches taken round-robin over the rules that match (every matching rule first, then more)."""
    by_rule: dict[str, list[Match]] = {}
    for m in matches:
        by_rule.setdefault(m.rule, []).append(m)
    chosen, depth = [], 0
    while len(chosen) < count and any(depth < len(v) for v in by_rule.values()):
        for ms in by_rule.values():
            if depth < len(ms) and len(chosen) < count:
                chosen.append(ms[depth])
        depth += 1
    return chosen


def _apply_steps(graph: Graph, match: Match, rules: dict[str, Rule]) -> dict[str, float]:
    """`base.apply`, step by step, timed (the steps are the same calls apply makes)."""
    clock = time.perf_counter
    t0 = clock()
    result = graph.clone()
    t1 = clock()
    nodes = result.node_map()
    rule = rules[match.rule]
    again = rule.check(result, nodes[match.root])
    assert again == match, again
    t2 = clock()
    rule.rewrite(result, match, nodes)
    t3 = clock()
    result.finish_edit()
    t4 = clock()
    return {"clone": t1 - t0, "check": t2 - t1, "rewrite": t3 - t2, "finish_edit": t4 - t3}


def _finish_parts(graph: Graph) -> dict[str, float]:
    """finish_edit's three parts on a fresh clone: gs cleanup, toposort, onnx shape inference."""
    clone = graph.clone()
    clock = time.perf_counter
    t0 = clock()
    clone.gs.cleanup(remove_unused_graph_inputs=False)
    t1 = clock()
    clone.gs.toposort()
    t2 = clock()
    clone.infer_shapes()
    t3 = clock()
    skeleton = shapes.skeleton(clone)  # infer_shapes = this export of the nodes to a proto + onnx's inference + copy-back
    t4 = clock()
    onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    t5 = clock()
    return {"cleanup": t1 - t0, "toposort": t2 - t1, "infer_shapes": t3 - t2, "infer_shapes.skeleton": t4 - t3,
            "infer_shapes.onnx": t5 - t4}


def _median(values) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def run(names=DEFAULT_MODELS, models_dir: Path = Path("models"), repeats: int = 5, applies: int = 40,
        profile: bool = False, command: str = "rlflow bench-rules") -> dict:
    """Measures and returns the figures (see the module docstring)."""
    logging.getLogger("rlflow").setLevel(logging.ERROR)
    started = time.perf_counter()
    graph = stacked_graph(list(names), models_dir)
    load_s = time.perf_counter() - started

    find_times, matches = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        matches = find_matches(graph)
        find_times.append(time.perf_counter() - t)
    per_rule = []
    for rule in RULES:  # each rule's own median: a rule ported to another matcher is compared with itself
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            rule.find(graph)
            times.append(time.perf_counter() - t)
        per_rule.append((_median(times), rule.name))
    per_rule.sort(reverse=True)

    chosen = _spread(matches, applies)
    rules = {r.name: r for r in RULES}
    if chosen:
        apply(graph, chosen[0])  # warm-up (imports, caches)
    apply_times, steps = [], []
    for match in chosen:
        t = time.perf_counter()
        apply(graph, match)
        apply_times.append(time.perf_counter() - t)
        steps.append(_apply_steps(graph, match, rules))
    parts = [_finish_parts(graph) for _ in range(7)]

    figures = {
        "command": command,
        "graph": {"models": list(names), "nodes": len(graph), "opset": graph.opset, "load_s": round(load_s, 2)},
        "rules": len(RULES),
        "find_matches": {"median_s": _median(find_times), "min_s": min(find_times), "runs": repeats,
                         "matches": len(matches), "rules_matching": len({m.rule for m in matches}),
                         "slowest_rules_s": [[name, round(s, 5)] for s, name in per_rule[:5]],
                         "by_rule_median_s": {name: round(s, 6) for s, name in sorted(per_rule, key=lambda p: p[1])},
                         "target_s": FIND_TARGET_S},
        "apply": {"median_s": _median(apply_times), "p90_s": (sorted(apply_times)[int(0.9 * (len(apply_times) - 1))]
                                                               if apply_times else None),
                  "max_s": max(apply_times) if apply_times else None, "matches_timed": len(apply_times),
                  "rules_timed": len({m.rule for m in chosen}), "target_s": APPLY_TARGET_S,
                  "by_rule_median_s": {name: round(_median([t for m, t in zip(chosen, apply_times) if m.rule == name]), 4)
                                       for name in dict.fromkeys(m.rule for m in chosen)},
                  "steps_median_s": {k: _median([s[k] for s in steps]) for k in ("clone", "check", "rewrite",
                                                                                   "finish_edit")},
                  "finish_edit_parts_median_s": {k: _median([p[k] for p in parts]) for k in ("cleanup", "toposort",
                                                                                               "infer_shapes",
                                                                                               "infer_shapes.skeleton",
                                                                                               "infer_shapes.onnx")}},
        "machine": {"python": platform.python_version(), "onnx": onnx.__version__, "cpus": os.cpu_count(),
                    "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
                    "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d"),
    }
    if profile and chosen:
        profiler = cProfile.Profile()
        profiler.enable()
        for match in chosen:
            apply(graph, match)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        figures["apply"]["profile_top"] = out.getvalue()
    return figures


def report(figures: dict) -> str:
    """The figures as a small table."""
    find, app = figures["find_matches"], figures["apply"]
    steps, parts = app["steps_median_s"], app["finish_edit_parts_median_s"]
    ok = lambda value, target: "yes" if value < target else "NO"  # noqa: E731
    lines = [
        f"graph: {'+'.join(figures['graph']['models'])}, {figures['graph']['nodes']} nodes, "
        f"{figures['rules']} rules, {find['matches']} matches from {find['rules_matching']} rules",
        "",
        "| measure | median | target | met |",
        "| --- | --- | --- | --- |",
        f"| find_matches, all rules ({find['runs']} runs) | {_ms(find['median_s'])} | < 1 s | "
        f"{ok(find['median_s'], find['target_s'])} |",
        f"| apply ({app['matches_timed']} matches of {app['rules_timed']} rules) | {_ms(app['median_s'])} | < 50 ms | "
        f"{ok(app['median_s'], app['target_s'])} |",
        f"| - Graph.clone | {_ms(steps['clone'])} | | |",
        f"| - re-check on the clone | {_ms(steps['check'])} | | |",
        f"| - rule.rewrite | {_ms(steps['rewrite'])} | | |",
        f"| - Graph.finish_edit | {_ms(steps['finish_edit'])} | | |",
        f"|   - gs cleanup | {_ms(parts['cleanup'])} | | |",
        f"|   - gs toposort | {_ms(parts['toposort'])} | | |",
        f"|   - Graph.infer_shapes | {_ms(parts['infer_shapes'])} | | |",
        f"|     - shapes.skeleton (nodes to a proto) | {_ms(parts['infer_shapes.skeleton'])} | | |",
        f"|     - onnx.shape_inference | {_ms(parts['infer_shapes.onnx'])} | | |",
        "",
        f"apply p90 {_ms(app['p90_s']).strip()}, max {_ms(app['max_s']).strip()}; by rule: "
        + ", ".join(f"{n} {s * 1000:.0f} ms" for n, s in app["by_rule_median_s"].items()),
        "slowest rules in find_matches: " + ", ".join(f"{n} {s * 1000:.1f} ms" for n, s in find["slowest_rules_s"]),
    ]
    return "\n".join(lines)


def bench_rules(names=DEFAULT_MODELS, models_dir: Path = Path("models"), repeats: int = 5, applies: int = 40,
                out: str | Path | None = "docs/results/rules-speed.json", profile: bool = False,
                command: str = "rlflow bench-rules") -> dict:
    """`rlflow bench-rules`: `run`, its table printed (with `profile`, cProfile's view of apply too) and its figures
    written as JSON to `out` (None or '': none), with `command` recorded as what produced them; returns them."""
    figures = run(list(names), Path(models_dir), repeats, applies, profile, command)
    print(report(figures))
    if profile:
        print(figures["apply"]["profile_top"])
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in figures.items()}
        saved["apply"] = {k: v for k, v in figures["apply"].items() if k != "profile_top"}
        out.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"wrote {out}")
    return figures
