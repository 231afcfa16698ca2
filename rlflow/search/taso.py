"""TASO-style backtracking search: a priority queue ordered by estimated cost, relaxed by alpha.

As in TASO (Jia et al., SOSP'19): pop the cheapest graph, apply every rewrite, keep children whose estimated cost is
below alpha x the best so far (alpha > 1 lets the search pass through slightly worse graphs), deduplicate by
fingerprint, and stop at a budget.  Estimates come from the cost model; the few best graphs are then measured end to
end against the input and the fastest one that is measurably faster wins.

The time limit covers both phases: expansion stops early enough to leave the final measurement what a probe of the
input predicts one candidate needs (a quarter of the limit at least), and the measurement then starts only the
batches that fit (see `rlflow.search.selection`).
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Sequence

from tqdm import tqdm

from rlflow.graph.core import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace
from rlflow.rewrites import RULES, Rule
from rlflow.search.candidates import Candidate, SearchResult, children
from rlflow.search.frozen_heap import frozen_heap
from rlflow.search.selection import (
    cost_table_lines,
    coverage,
    measurement_reserve,
    measuring_until,
    select_estimated,
    select_measured,
)


@dataclass
class TasoConfig:
    """Settings of the backtracking search.

    Attributes:
        alpha: children costing up to alpha x the best estimate stay in the queue (TASO uses 1.0-1.05).
        budget: graphs expanded at most.
        time_limit: seconds for the whole search, final measurements included; overrun by at most one step that
            cannot be interrupted (see `rlflow.search.selection`).
        max_growth: children with more than this factor x the input's node count are dropped (TASO: 2).
        top_k: best-estimated graphs measured end to end at the end.
        rounds: interleaved rounds of those final measurements.
        seed: inputs and round order.
        measure: False ends on the graph the cost model prices lowest, measuring nothing (scoring for a provider this
            machine lacks: `rlflow bench-estimate`).
    """

    alpha: float = 1.05
    budget: int = 200
    time_limit: float = 60.0
    max_growth: float = 2.0
    top_k: int = 6
    rounds: int = 15
    seed: int = 0
    measure: bool = True


def taso(graph: Graph, settings: SessionSettings, config: TasoConfig | None = None, rules: Sequence[Rule] = RULES,
         cost_model=None, progress: bool = False) -> SearchResult:
    """Backtracking search guided by the cost model; see the module docstring."""
    from rlflow.measure.costmodel.model import CostModel

    config = config or TasoConfig()
    cost_model = cost_model if cost_model is not None else CostModel(settings)  # an empty one is falsy
    start = time.monotonic()
    pace = Pace()
    reserve = measurement_reserve(graph, settings, config.time_limit, pace, config.seed) if config.measure else 0.0
    search_deadline = start + config.time_limit - reserve
    # a cold table must not take the whole limit; the heap held before the search out of the collector's rescans
    with measuring_until(cost_model, search_deadline), frozen_heap():
        root = Candidate(graph, (), graph.fingerprint())
        best_cost = cost_model.graph_cost(graph)
        order = itertools.count()
        queue = [(best_cost, next(order), root)]
        seen = {root.fingerprint}
        pool: list[tuple[float, int, Candidate]] = []  # the top_k cheapest rewritten graphs
        expanded, estimated = 0, 0
        with tqdm(total=config.budget, desc="taso", unit="graph", disable=not progress, leave=False) as bar:
            while True:
                stop = _stop(expanded, config.budget, queue, search_deadline)
                if stop:
                    break
                cost, _, parent = heapq.heappop(queue)
                if cost > config.alpha * best_cost:
                    continue
                expanded += 1
                bar.update(1)
                for child in children(parent, rules, seen, search_deadline):  # estimated as they come: see `children`
                    if len(child.graph) > config.max_growth * len(graph):
                        continue
                    child_cost = cost_model.graph_cost(child.graph)
                    estimated += 1
                    entry = (child_cost, next(order), child)
                    if child_cost < best_cost:
                        best_cost = child_cost
                        bar.set_postfix_str(f"best {best_cost:.3f} ms (estimated)")
                    if child_cost < config.alpha * best_cost:
                        heapq.heappush(queue, entry)
                    pool = heapq.nsmallest(config.top_k, pool + [entry])
    cost_model.save()
    if config.measure:
        result = select_measured(graph, [c for _, _, c in pool], settings, rounds=config.rounds, seed=config.seed,
                                 deadline=start + config.time_limit, start=start,
                                 stop_reason=f"{stop} after {expanded} expanded", estimated=estimated, pace=pace)
    else:
        result = select_estimated(graph, [(cost, c) for cost, _, c in pool], cost_model.graph_cost(graph),
                                  start=start, stop_reason=f"{stop} after {expanded} expanded", estimated=estimated)
    result.cost_table = coverage(cost_model)
    late = cost_table_lines(result.cost_table)
    if stop == "time limit":
        late.append(f"taso: stopped at the limit after {expanded} of at most {config.budget} graphs expanded, "
                    f"{len(queue)} left in the queue")
    result.not_reached[:0] = late
    return result


def _stop(expanded: int, budget: int, queue: list, deadline: float) -> str | None:
    """Why the search stops now, or None."""
    if expanded >= budget:
        return "budget"
    if time.monotonic() > deadline:
        return "time limit"
    return None if queue else "queue exhausted"
