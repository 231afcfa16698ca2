"""Random walks with restarts: the baseline any learned policy must beat.

Each walk starts from the input and applies uniformly random rewrites; every graph visited is scored with the cost
model, and the best few are measured end to end against the input at the end, within the time limit as in
`rlflow.search.taso`.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tqdm import tqdm

from rlflow.graph.core import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace
from rlflow.rewrites import RULES, Rule, find_matches
from rlflow.search.candidates import Candidate, SearchResult, try_apply
from rlflow.search.frozen_heap import frozen_heap
from rlflow.search.selection import cost_table_lines, coverage, measurement_reserve, measuring_until, select_measured


@dataclass
class RandomConfig:
    """Settings of the random walks.

    Attributes:
        walks: restarts from the input.
        length: rewrites per walk at most.
        time_limit: seconds for the whole search, final measurements included.
        top_k: best-estimated graphs measured end to end at the end.
        rounds: interleaved rounds of those final measurements.
        seed: the walks, the inputs and the round order.
    """

    walks: int = 20
    length: int = 10
    time_limit: float = 60.0
    top_k: int = 6
    rounds: int = 15
    seed: int = 0


def random_walk(graph: Graph, settings: SessionSettings, config: RandomConfig | None = None,
                rules: Sequence[Rule] = RULES, cost_model=None, progress: bool = False) -> SearchResult:
    """Random walks with restarts; see the module docstring."""
    from rlflow.measure.costmodel.model import CostModel

    config = config or RandomConfig()
    cost_model = cost_model if cost_model is not None else CostModel(settings)  # an empty one is falsy
    rng = np.random.default_rng(config.seed)
    start = time.monotonic()
    pace = Pace()
    search_deadline = start + config.time_limit - measurement_reserve(graph, settings, config.time_limit, pace,
                                                                      config.seed)
    order = itertools.count()
    root_fingerprint = graph.fingerprint()
    pool: list[tuple[float, int, Candidate]] = []
    pooled = {root_fingerprint}
    estimated, stop = 0, "all walks done"
    walked = 0
    # a cold table must not take the whole limit; the heap held before the search out of the collector's rescans
    with measuring_until(cost_model, search_deadline), frozen_heap():
        with tqdm(total=config.walks, desc="random", unit="walk", disable=not progress, leave=False) as bar:
            for _ in range(config.walks):
                current = Candidate(graph, (), root_fingerprint)
                for _ in range(config.length):
                    if time.monotonic() > search_deadline:
                        break
                    matches = find_matches(current.graph, rules)
                    if not matches:
                        break
                    match = matches[int(rng.integers(len(matches)))]
                    child = try_apply(current.graph, match, rules)
                    if child is None:
                        continue
                    current = Candidate(child, current.applied + (match,), child.fingerprint())
                    if current.fingerprint in pooled:
                        continue
                    pooled.add(current.fingerprint)
                    estimated += 1
                    pool = heapq.nsmallest(config.top_k, pool + [(cost_model.graph_cost(child), next(order), current)])
                bar.update(1)
                walked += 1
                if time.monotonic() > search_deadline:
                    stop = "time limit"
                    break
    cost_model.save()
    result = select_measured(graph, [c for _, _, c in pool], settings, rounds=config.rounds, seed=config.seed,
                             deadline=start + config.time_limit, start=start, stop_reason=stop, estimated=estimated,
                             pace=pace)
    result.cost_table = coverage(cost_model)
    late = cost_table_lines(result.cost_table)
    if stop == "time limit":
        late.append(f"random: {walked} of {config.walks} walks before the limit")
    result.not_reached[:0] = late
    return result
