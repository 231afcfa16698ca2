"""The agent's prior candidates: every fusion applied wherever it matches, with the one undoing the cost model prefers
(and the runner-up where the cost model had to estimate).

Measured beside the rollouts' graphs, it is what greedy measures first, and on an export unlike the agent's training
set the graph its policy most often misses.  The cost table knows what one measurement against the input cannot show
among four candidates: on the CPU onnxruntime's SkipLayerNormalization was slower than the Adds and
LayerNormalization it replaces on every encoder measured, so every fusion at once gains more with it undone
(docs/results/agent-wide/prior/skip-layernorm.md).
"""
from __future__ import annotations

import time
from typing import Sequence

from rlflow.rewrites import GROUPS, Rule
from rlflow.search.candidates import Candidate, all_fusions, coverage, everywhere, measuring_until

INVERSE_NAMES = frozenset(r.name for r in GROUPS["inverse"])

PRICING_SECONDS = 1.0
"""Seconds of cost-table measurements at most for pricing the variants."""


def fuse_everything(start: Candidate, pool: Sequence[Candidate], rules: Sequence[Rule], cost_model,
                    deadline: float) -> list[Candidate]:
    """The fuse-everything graphs of `start` (the input, fingerprinted: `all_fusions`) to measure, cheapest first:
    every fusion at once, or with one inverse rule among `rules` applied everywhere where the cost model prices that
    lower; and the runner-up too where the cost model priced them partly by estimates (the table lacked groups and
    the time to measure them).  None of them is the input or already in `pool`.

    The groups that tell the variants apart are priced first (`CostModel.graph_costs`): on an empty table the pricing
    time otherwise went to the largest groups, which the variants share, and the wrong variant was measured
    (docs/results/cold-table/).
    """
    taken = {start.fingerprint, *(c.fingerprint for c in pool)}
    fused = all_fusions(start, rules, set(taken), deadline)
    if fused is None:
        return []
    inverses = [r for r in rules if r.name in INVERSE_NAMES]
    variants = [fused, *everywhere(fused, inverses, taken | {fused.fingerprint}, deadline)]
    if len(variants) == 1:
        return variants
    with measuring_until(cost_model, min(deadline, time.monotonic() + PRICING_SECONDS)):
        prices = _prices_apart(cost_model, [c.graph for c in variants])
        priced = coverage(cost_model)
    ranked = [variants[i] for i in sorted(range(len(variants)), key=prices.__getitem__)]
    return ranked[:2] if priced and priced["estimated"] else ranked[:1]


def _prices_apart(cost_model, graphs) -> list[float]:
    """The graphs' costs, what sets them apart measured first where the cost model can (`CostModel.graph_costs`)."""
    apart = getattr(cost_model, "graph_costs", None)
    return apart(graphs) if apart is not None else [cost_model.graph_cost(graph) for graph in graphs]
