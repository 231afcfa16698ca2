"""Which layers drop precision, chosen by measured error and measured speed (`rlflow optimize --precision`).

Each quantizable product is measured once per precision rule: its error (that product alone on the activations the
samples give it, onnxruntime's kernel against float32) beside its speed gain (that product at its deployed shape,
among a model's worth of copies, interleaved against float32 on the target provider).  A threshold on that local
error then decides every layer at once: each takes its fastest form whose error is under it, and a form that is not
measurably faster is never taken, so the layers least hurt drop first, as accuracy-driven tuners fall back layer by
layer, but with speed measured on the target deciding the form.  The threshold is the largest, by bisection over the
measured errors, at which the whole model's error on the samples stays within the budget: a model's error grows with
the layers it loses, so a handful of whole-model evaluations decide.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rlflow.errors import RlflowError
from rlflow.graph.core import Graph
from rlflow.measure.accuracy import ErrorReport, Evaluator
from rlflow.measure.session import SessionSettings, create_session
from rlflow.measure.verify import OutputCheck
from rlflow.rewrites import Match, apply_all, find_matches
from rlflow.rewrites.precision import MIN_WEIGHT_ELEMENTS, PrecisionRule, Replacement

log = logging.getLogger("rlflow")

LOCAL_ROWS = 512
"""Activation rows per layer the local error is measured on (a sample's rows, the first samples first)."""

MIN_GAIN = 0.05
"""A variant counts as faster alone only when it saves this share of the float32 product's time."""

TIMING_RUNS = 25
"""Interleaved runs of each product when timing a layer alone (medians compared)."""

STREAM_BYTES = 2**27
"""A layer is timed as one of as many copies as the model has float32 weight bytes, up to this many: a decode step's
weights stream from memory at every step, which one layer timed alone, its weights left in the cache by the run
before, never shows (at one row per product, int8 measured faster than int4 alone; over the model, int4 reads half
the bytes)."""


@dataclass
class Layer:
    """One MatMul and what each precision rule would do to it."""

    node: str
    shape: tuple[int, int, int]
    """(rows per run, K, N)."""
    weight_bytes: int
    variants: dict[str, dict] = field(default_factory=dict)
    """rule name -> {match, error (local; None where not measured alone), gain_ms, bytes, faster}."""
    chosen: str | None = None

    def pick(self, threshold: float) -> str | None:
        """The fastest variant whose local error is within `threshold`, among those faster alone."""
        fits = [(v["gain_ms"] or 0.0, -v["bytes"], name) for name, v in self.variants.items()
                if (v["error"] or 0.0) <= threshold and v["faster"]]
        return max(fits)[2] if fits else None


@dataclass
class PrecisionSearch:
    """What the precision search chose and why."""

    graph: Graph
    applied: list[Match]
    layers: list[Layer]
    error: ErrorReport | None
    threshold: float | None
    evaluations: list[dict]
    stop_reason: str
    seconds: float
    least_error: float | None = None

    def counts(self) -> dict[str, int]:
        """Layers per outcome: each rule's name, and `float32` for those kept."""
        out: dict[str, int] = {}
        for layer in self.layers:
            key = layer.chosen or "float32"
            out[key] = out.get(key, 0) + 1
        return out


def precision_search(graph: Graph, evaluator: Evaluator, settings: SessionSettings, rules: Sequence[PrecisionRule],
                     budget: float, progress: bool = False) -> PrecisionSearch:
    """The layers of `graph` to rewrite with `rules` so that the error against `evaluator`'s reference stays within
    `budget` (relative error norm of every output), fastest first; `graph` itself is untouched."""
    start = time.monotonic()
    layers = _measure_layers(graph, evaluator, settings, rules, progress)
    if not layers:
        return PrecisionSearch(graph, [], [], None, None, [], "no layer the precision rules take (a MatMul or Gemm "
                               f"with a float32 constant weight of at least {MIN_WEIGHT_ELEMENTS} values)",
                               time.monotonic() - start)
    return choose(graph, layers, Choices(graph, evaluator, rules), budget, start)


class Choices:
    """Evaluates a choice of layers (every rewrite a threshold picks) once: the graph with it, and its error."""

    def __init__(self, graph: Graph, evaluator: Evaluator, rules: Sequence[PrecisionRule]):
        self.graph, self.evaluator, self.rules = graph, evaluator, rules
        self.evaluations: list[dict] = []
        self.seen: dict[tuple, tuple[Graph, list[Match], ErrorReport]] = {}

    def evaluate(self, chosen: Sequence[Match], label: float | None = None) -> tuple[Graph, list[Match], ErrorReport]:
        """`graph` with `chosen` applied, the rewrites applied, and the error on the samples (infinite, and said,
        where onnxruntime cannot run it)."""
        key = tuple(chosen)
        if key in self.seen:  # thresholds between two measured errors choose alike
            return self.seen[key]
        candidate, applied = apply_all(self.graph, chosen, self.rules)
        try:
            report = self.evaluator.error(candidate.to_model(static=False))
        except RlflowError as exc:  # onnxruntime cannot run it: as if over any budget, and said
            inf = float("inf")
            report = ErrorReport([OutputCheck(f"(fails to run: {exc})", inf, inf, inf, self.evaluator.budget, False)],
                                 self.evaluator.samples.source)
        self.evaluations.append({"threshold": label, "layers": len(applied), "max_error": report.max_error})
        log.info("precision: %s%d layers, error %.3g", "" if label is None else f"local error <= {label:.3g}: ",
                 len(applied), report.max_error)
        self.seen[key] = candidate, applied, report
        return self.seen[key]


def choose(graph: Graph, layers: list[Layer], choices: Choices, budget: float, start: float) -> PrecisionSearch:
    """The layers' forms within `budget`, in two bisections (a model's error grows with the layers it loses), each
    trying everything first, so that where everything fits, the usual case, one evaluation decides:

    1. the largest threshold on the layers' measured errors at which the whole model stays within the budget, each
       layer taking its fastest form under it;
    2. then, from that choice, each layer's fastest form, the most gain per unit of error first, as many as still fit.
       The threshold alone moves layers whose forms err alike all at once (on random weights every int4 layer errs
       about 0.1), so where all of them do not fit it took none, though the largest layer alone (a language model's
       head) fits and pays most.
    """
    usable = sorted({v["error"] or 0.0 for layer in layers for v in layer.variants.values() if v["faster"]})
    if not usable:
        return PrecisionSearch(graph, [], layers, None, None, choices.evaluations,
                               "no layer is faster in a lower precision", time.monotonic() - start)

    def evaluate(names: list[str | None], label: float | None) -> tuple[Graph, list[Match], ErrorReport]:
        return choices.evaluate([layer.variants[n]["match"] for layer, n in zip(layers, names) if n], label)

    def picks(threshold: float) -> list[str | None]:
        return [layer.pick(threshold) for layer in layers]

    best, least = _largest_within(len(usable), lambda i: evaluate(picks(usable[i]), usable[i]), budget)
    threshold = usable[best[0]] if best else None  # None: no threshold fits, the upgrades start from float32
    names, outcome = (picks(threshold), best[1]) if best else ([None] * len(layers), None)
    upgrades = _upgrades(layers, names)

    def upgraded(k: int) -> list[str | None]:
        out = list(names)
        for i, name in upgrades[:k + 1]:
            out[i] = name
        return out

    more, fewer = _largest_within(len(upgrades), lambda k: evaluate(upgraded(k), None), budget)
    if more is not None:
        names, outcome = upgraded(more[0]), more[1]
    if outcome is None:
        least = min(e for e in (least, fewer) if e is not None)
        return PrecisionSearch(graph, [], layers, None, None, choices.evaluations,
                               f"no choice is within the error budget {budget:.3g} (least error reached "
                               f"{least:.3g})", time.monotonic() - start, least_error=least)
    candidate, applied, report = outcome
    for layer, name in zip(layers, names):
        layer.chosen = name
    return PrecisionSearch(candidate, applied, layers, report, threshold, choices.evaluations,
                           f"{len(applied)} of {len(layers)} layers in lower precision", time.monotonic() - start)


def _largest_within(count: int, evaluate: Callable[[int], tuple[Graph, list[Match], ErrorReport]], budget: float
                    ) -> tuple[tuple[int, tuple] | None, float | None]:
    """The largest i below `count` whose evaluation is within `budget` (with that evaluation), by bisection, the last
    tried first; and the least error any evaluation reached."""
    best, least = None, None
    low, high = 0, count - 1
    probe = high
    while low <= high:
        outcome = evaluate(probe)
        error = outcome[2].max_error
        least = error if least is None else min(least, error)
        if error <= budget:
            best = (probe, outcome)
            low = probe + 1
        else:
            high = probe - 1
        probe = (low + high + 1) // 2
    return best, least


def _upgrades(layers: list[Layer], names: list[str | None]) -> list[tuple[int, str]]:
    """Each layer's fastest form where it is faster than the one in `names`, as (layer index, form), the most time
    saved per unit of local error added first."""
    found = []
    for i, (layer, now) in enumerate(zip(layers, names)):
        gain, error = (layer.variants[now]["gain_ms"] or 0.0, layer.variants[now]["error"] or 0.0) if now else (0, 0)
        faster = [(v["gain_ms"] or 0.0, name) for name, v in layer.variants.items() if v["faster"]]
        if faster and max(faster)[0] > gain:
            top, name = max(faster)
            added = max((layer.variants[name]["error"] or 0.0) - error, 1e-12)
            found.append(((top - gain) / added, i, name))
    return [(i, name) for _, i, name in sorted(found, key=lambda f: -f[0])]


def _measure_layers(graph: Graph, evaluator: Evaluator, settings: SessionSettings,
                    rules: Sequence[PrecisionRule], progress: bool) -> list[Layer]:
    """Every quantizable MatMul with each rule's local error and speed gain."""
    by_root: dict[str, list[Match]] = {}
    for match in find_matches(graph, rules):
        by_root.setdefault(match.root, []).append(match)
    if not by_root:
        return []
    nodes = graph.node_map()
    activations = _activations(graph, evaluator, [nodes[r].inputs[0].name for r in by_root])
    rule_of = {r.name: r for r in rules}
    weights = {r: PrecisionRule.operands(nodes[r])[0] for r in by_root}  # a bias costs the same in every precision
    model_bytes = sum(w.nbytes for w in weights.values())
    timings: dict[tuple, float] = {}
    layers = []
    roots = list(by_root)
    if progress:
        from tqdm import tqdm

        roots = tqdm(roots, desc="precision: layers", unit="layer")
    for root in roots:
        node = nodes[root]
        weight = weights[root]
        k, n = weight.shape
        a_shape = graph.shape(node.inputs[0])
        rows = int(np.prod(a_shape[:-1])) if a_shape else 1
        layer = Layer(root, (rows, k, n), weight.nbytes)
        a = activations[node.inputs[0].name]
        reference = a @ weight
        copies = max(1, min(model_bytes, STREAM_BYTES) // weight.nbytes)
        for match in by_root[root]:
            rule = rule_of[match.rule]
            new = rule.replacement(weight)
            product = _product_model(k, n, new.op, new.attrs, new.constants)
            out = create_session(product, SessionSettings(threads=settings.threads)).run(None, {"a": a})[0]
            error = float(np.linalg.norm(out - reference) / max(np.linalg.norm(reference), 1e-30))
            key = (rows, k, n, rule.name, copies)
            if key not in timings:
                timings[key] = _gain_ms(rows, weight, new, settings, copies)
            layer.variants[rule.name] = {"match": match, "error": error, "gain_ms": timings[key],
                                         "bytes": new.nbytes, "faster": timings[key] > 0}
        layers.append(layer)
    return layers


def _activations(graph: Graph, evaluator: Evaluator, names: list[str]) -> dict[str, np.ndarray]:
    """Each tensor of `names` on the samples, as [rows, K] (at most LOCAL_ROWS rows)."""
    model = graph.to_model(static=False)
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in dict.fromkeys(names)
                              if n not in known)
    session = create_session(model, evaluator.settings)
    rows: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feeds in evaluator.samples.feeds:
        outs = session.run(list(rows), feeds)
        for name, value in zip(rows, outs):
            if sum(len(r) for r in rows[name]) < LOCAL_ROWS:
                rows[name].append(value.reshape(-1, value.shape[-1]))
        if all(sum(len(r) for r in v) >= LOCAL_ROWS for v in rows.values()):
            break
    return {n: np.ascontiguousarray(np.concatenate(v)[:LOCAL_ROWS], dtype=np.float32) for n, v in rows.items()}


def _product_model(k: int, n: int, op: str, attrs: dict, constants: Sequence[np.ndarray],
                   copies: int = 1) -> onnx.ModelProto:
    """`op(a, *constants)`: a [rows, K] -> [rows, N] (MatMul in the default domain, the rest com.microsoft), `copies`
    times side by side on the same `a`, each with its own copy of the constants."""
    nodes, outputs, initializers = [], [], []
    for j in range(copies):
        names = [f"c{j}_{i}" for i in range(len(constants))]
        nodes.append(helper.make_node(op, ["a", *names], [f"y{j}"], domain="" if op == "MatMul" else "com.microsoft",
                                      **attrs))
        outputs.append(helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, ["rows", n]))
        initializers += [numpy_helper.from_array(c, name) for c, name in zip(constants, names)]
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
                              outputs, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _gain_ms(rows: int, weight: np.ndarray, new: Replacement, settings: SessionSettings, copies: int) -> float:
    """Milliseconds one layer in form `new` saves against float32 at `rows` rows, timed on the target as one of
    `copies` (STREAM_BYTES), interleaved runs, medians; 0 where it does not save MIN_GAIN of the float32 time."""
    k, n = weight.shape
    models = (_product_model(k, n, "MatMul", {}, [weight], copies),
              _product_model(k, n, new.op, new.attrs, new.constants, copies))
    # a product's rows are dynamic, which capture refuses; and its copies are small, so its weights are pre-packed as
    # a deployed session's are: shared in place (a large model's setting), MatMulNBits lost its fast path and no int4
    # layer of Qwen3-0.6B-L8's step measured faster than float32
    plain = replace(settings, cuda_graph=False, share_weights=False)
    sessions = [create_session(m, plain) for m in models]
    feeds = {"a": np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)}
    times: list[list[float]] = [[], []]
    for i in range(TIMING_RUNS + 3):
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            sessions[j].run(None, feeds)
            if i >= 3:
                times[j].append(time.perf_counter() - t0)
    fp32, quantized = (statistics.median(t) * 1e3 / copies for t in times)
    gain = fp32 - quantized
    return gain if gain >= MIN_GAIN * fp32 else 0.0
