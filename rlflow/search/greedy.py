"""Greedy search: apply the rewrite with the best measured gain, repeat until no rewrite is measurably faster.

A step's candidates are every single rewrite, and every rule that matches in several places applied at all of them
(`everywhere`): the layers of a network usually want the same decision, and together their gain stands out of the
measurement's noise."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from tqdm import tqdm

from rlflow.graph import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace
from rlflow.rewrites import RULES, Rule
from rlflow.search.candidates import Candidate, SearchResult, everywhere, expand, fastest, measure_against


@dataclass
class GreedyConfig:
    """Settings of the greedy search.

    Attributes:
        time_limit: seconds; no new measurement starts after it (the best graph so far is returned).
        max_steps: rewrites applied at most.
        max_candidates: candidates measured per step (those with the fewest nodes first).
        rounds: interleaved rounds per candidate measurement (quick; the final gate measures longer).
        seed: inputs and round order.
    """

    time_limit: float = 60.0
    max_steps: int = 50
    max_candidates: int = 24
    rounds: int = 9
    seed: int = 0


def greedy(graph: Graph, settings: SessionSettings, config: GreedyConfig | None = None,
           rules: Sequence[Rule] = RULES, progress: bool = False) -> SearchResult:
    """Greedy search over `rules`, measuring candidates end to end on `settings.provider`."""
    config = config or GreedyConfig()
    start = time.monotonic()
    deadline = start + config.time_limit
    current = Candidate(graph, (), graph.fingerprint())
    seen = {current.fingerprint}
    steps, measured, unmeasured, stop = [], 0, 0, "step limit"
    pace = Pace()  # shared by the steps: every step's candidates are about the size of the input
    with tqdm(total=config.max_steps, desc="greedy", unit="step", disable=not progress, leave=False) as bar:
        for _ in range(config.max_steps):
            if time.monotonic() > deadline:
                stop = "time limit"
                break
            candidates = expand(current, rules, seen, deadline) + list(everywhere(current, rules, seen, deadline))
            candidates.sort(key=lambda c: len(c.graph))  # fewer nodes first: the cheapest ranking before measuring
            if not candidates:
                stop = "no rewrite applies"
                break
            results = measure_against(current.graph, candidates[: config.max_candidates], settings,
                                      rounds=config.rounds, seed=config.seed, deadline=deadline, pace=pace)
            measured += len(results.pairs)
            best = fastest(results.pairs)
            if best is None:
                unmeasured = results.unmeasured
                out_of_time = results.unmeasured or time.monotonic() > deadline
                stop = "time limit" if out_of_time else "no rewrite is measurably faster"
                break
            rewrites = len(best[0].applied) - len(current.applied)
            current, ratio = best
            steps.append({"rule": current.match.rule, "location": current.match.root, "step_speedup": ratio.as_dict(),
                          "nodes": len(current.graph), "rewrites": rewrites})
            bar.update(1)
            bar.set_postfix_str(f"{current.match.rule} {ratio}")
    return SearchResult(current.graph, list(current.applied), measured, time.monotonic() - start, stop, steps,
                        candidates_unmeasured=unmeasured)
