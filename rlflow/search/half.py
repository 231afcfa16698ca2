"""Which nodes compute in half precision (`rlflow optimize --precision fp16|bf16`), chosen by measured error.

Every node the rule offers is tried in half at once first: half precision costs a transformer about 1e-3 of relative
error, so that usually fits the budget and one evaluation decides. Where it does not, each node's sensitivity is
measured, the whole model's error with that node alone in half, and the threshold search of the integer precisions
(`rlflow.search.precision.choose`) keeps the most sensitive in float32, as accuracy-driven tuners fall back node by
node. Speed is not measured per node: a half node's time depends on whether its neighbours are half too (the Casts
between them), so the gate's measurement of the whole model, on the target provider, decides whether it pays.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.measure.accuracy import Evaluator
from rlflow.measure.bootstrap import Ratio
from rlflow.measure.profile_comparison import compare_profiled
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import find_matches
from rlflow.rewrites.half import HalfPrecisionRule
from rlflow.search.precision import Choices, Layer, PrecisionSearch, choose

COMPARE_ROUNDS = 12


def half_search(graph: Graph, evaluator: Evaluator, settings: SessionSettings, rules: Sequence[HalfPrecisionRule],
                budget: float, progress: bool = False) -> PrecisionSearch:
    """The nodes of `graph` to compute in half so that the error against `evaluator`'s reference stays within
    `budget`, as many as it allows, where that is measurably faster than `graph` on `settings`' provider; `graph`
    itself is untouched."""
    start = time.monotonic()
    matches = find_matches(graph, rules)
    if not matches:
        return PrecisionSearch(graph, [], [], None, None, [], "no node the half-precision rules take (float32 "
                               "operators whose float tensors all share one type)", time.monotonic() - start)
    nodes = graph.node_map()
    layers = []
    for m in matches:
        node = nodes[m.root]
        weights = _float_bytes(node)
        layers.append(Layer(m.root, tuple(graph.shape(node.outputs[0]) or ()), weights,
                            {m.rule: {"match": m, "error": None, "gain_ms": None, "bytes": weights // 2,
                                      "faster": True}}))
    choices = Choices(graph, evaluator, rules)
    everything = choices.evaluate(matches, None)
    if everything[2].max_error > budget:  # some nodes must stay float32: which, by their error alone
        iterated = layers
        if progress:
            from tqdm import tqdm

            iterated = tqdm(layers, desc="precision: node sensitivity", unit="node")
        for layer in iterated:
            for variant in layer.variants.values():
                variant["error"] = choices.evaluate([variant["match"]], None)[2].max_error
    found = choose(graph, layers, choices, budget, start)
    if not found.applied:
        return found
    ratio = against_float32(graph, found.graph, settings)
    if not ratio.faster:
        for layer in layers:
            layer.chosen = None
        return replace(found, graph=graph, applied=[], error=None, threshold=None,
                       stop_reason=f"{rules[0].precision} is not measurably faster than float32 on "
                               f"{settings.provider}: {ratio} ({len(found.applied)} nodes in half within the budget)",
                       seconds=time.monotonic() - start)
    return replace(found, stop_reason=f"{found.stop_reason}, {ratio} against float32",
                   seconds=time.monotonic() - start)


def against_float32(graph: Graph, half: Graph, settings: SessionSettings) -> Ratio:
    """The speedup of `half` over `graph`, interleaved on the target at the graph's shapes and profiles, as the gate
    measures: per node a half kernel's speed depends on its neighbours, so the whole model decides, against the
    float32 graph it came from, where the gate compares with the input."""
    return compare_profiled([graph, half], settings, rounds=COMPARE_ROUNDS, seed=0,
                            labels=["float32", "half"]).ratios[1]


def _float_bytes(node: gs.Node) -> int:
    """Bytes of the float32 constants `node` reads."""
    return sum(t.values.nbytes for t in node.inputs
               if isinstance(t, gs.Constant) and t.values.dtype == np.float32)
