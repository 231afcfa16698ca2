"""The agent's prior candidates: every fusion applied wherever it matches, and the variants with one fusion undone
everywhere, the two the cost model prices lowest.

Measured beside the rollouts' graphs, they are what greedy measures first, and on an export unlike the agent's
training set the graph its policy most often misses.  The cost table knows much that one measurement against the
input cannot show among four candidates: on the CPU onnxruntime's SkipLayerNormalization was slower than the Adds and
LayerNormalization it replaces on every encoder measured, so every fusion at once gains more with it undone
(docs/agents.md).  But it prices groups timed apart, and on MiniLM-L12's three
held-out exports a filled table ranked every fusion first and the same with the skip-LayerNorms undone second, which
measured faster; its first two held the fastest on all eighteen held-out exports.  On an empty table it must also
estimate the groups that tell the variants apart.  So two are measured, and the measurement decides (docs/agents.md).
"""
from __future__ import annotations

import time
from typing import Sequence

from rlflow.rewrites import GROUPS, Rule
from rlflow.search.candidates import Candidate, all_fusions, everywhere
from rlflow.search.selection import measuring_until

INVERSE_NAMES = frozenset(r.name for r in GROUPS["inverse"])

PRICING_SECONDS = 1.0
"""Seconds of cost-table measurements at most for pricing the variants."""

VARIANTS_MEASURED = 2
"""Fuse-everything variants handed to the measurement, the cheapest by the cost model first."""


def fuse_everything(start: Candidate, rules: Sequence[Rule], cost_model, deadline: float) -> list[Candidate]:
    """The fuse-everything graphs of `start` (the input, fingerprinted: `all_fusions`) to measure, cheapest first:
    every fusion at once, and that graph with one inverse rule among `rules` applied everywhere, the
    VARIANTS_MEASURED the cost model prices lowest (none where no two fusion rules match).

    The groups that tell the variants apart are priced first (`CostModel.graph_costs`): on an empty table the pricing
    time otherwise went to the largest groups, which the variants share.
    """
    variants = fuse_variants(start, rules, deadline)
    if len(variants) < 2:
        return variants
    with measuring_until(cost_model, min(deadline, time.monotonic() + PRICING_SECONDS)):
        prices = _prices_apart(cost_model, [c.graph for c in variants])
    ranked = sorted(range(len(variants)), key=prices.__getitem__)
    return [variants[i] for i in ranked[:VARIANTS_MEASURED]]


def fuse_variants(start: Candidate, rules: Sequence[Rule], deadline: float | None = None) -> list[Candidate]:
    """Every fusion among `rules` applied to `start` wherever it matches (`all_fusions`), then that graph with each
    inverse rule applied everywhere; none where no two fusion rules match."""
    fused = all_fusions(start, rules, {start.fingerprint}, deadline)
    if fused is None:
        return []
    inverses = [r for r in rules if r.name in INVERSE_NAMES]
    return [fused, *everywhere(fused, inverses, {start.fingerprint, fused.fingerprint}, deadline)]


def _prices_apart(cost_model, graphs) -> list[float]:
    """The graphs' costs, what sets them apart measured first where the cost model can (`CostModel.graph_costs`)."""
    apart = getattr(cost_model, "graph_costs", None)
    return apart(graphs) if apart is not None else [cost_model.graph_cost(graph) for graph in graphs]
