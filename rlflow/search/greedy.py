"""Greedy search: apply the single rewrite with the best measured gain, repeat until no rewrite is measurably faster."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from tqdm import tqdm

from rlflow.errors import ProviderError
from rlflow.graph import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Ratio, compare
from rlflow.rewrites import RULES, Match, Rule
from rlflow.search.candidates import Candidate, expand

log = logging.getLogger("rlflow")


@dataclass
class GreedyConfig:
    """Settings of the greedy search.

    Attributes:
        time_limit: seconds; no new measurement starts after it (the best graph so far is returned).
        max_steps: rewrites applied at most.
        max_candidates: candidates measured per step (rewrites that remove the most nodes first).
        rounds: interleaved rounds per candidate measurement (quick; the final gate measures longer).
        batch: candidates measured in one interleaved comparison with the current graph.
        seed: inputs and round order.
    """

    time_limit: float = 60.0
    max_steps: int = 50
    max_candidates: int = 24
    rounds: int = 9
    batch: int = 6
    seed: int = 0


@dataclass
class SearchResult:
    """What a search found: the best graph, the rewrites that led to it and what it cost."""

    graph: Graph
    applied: list[Match]
    candidates_measured: int
    seconds: float
    stop_reason: str
    steps: list[dict] = field(default_factory=list)


def greedy(graph: Graph, settings: SessionSettings, config: GreedyConfig | None = None,
           rules: Sequence[Rule] = RULES, progress: bool = False) -> SearchResult:
    """Greedy search over `rules`, measuring candidates end to end on `settings.provider`."""
    config = config or GreedyConfig()
    start = time.monotonic()
    deadline = start + config.time_limit
    current, applied, steps = graph, [], []
    seen = {graph.fingerprint()}
    measured = 0
    stop = "step limit"
    bar = tqdm(total=config.max_steps, desc="greedy", unit="step", disable=not progress, leave=False)
    try:
        for _ in range(config.max_steps):
            if time.monotonic() > deadline:
                stop = "time limit"
                break
            candidates = expand(current, rules, seen)
            candidates.sort(key=lambda c: len(c.graph))  # fewer nodes first: cheapest way to rank before measuring
            candidates = candidates[: config.max_candidates]
            if not candidates:
                stop = "no rewrite applies"
                break
            best, best_ratio, count = _best_measured(current, candidates, settings, config, deadline)
            measured += count
            if best is None:
                stop = "no rewrite is measurably faster" if time.monotonic() <= deadline else "time limit"
                break
            current = best.graph
            applied.append(best.match)
            steps.append({"rule": best.match.rule, "location": best.match.root, "step_speedup": best_ratio.as_dict(),
                          "nodes": len(current)})
            bar.update(1)
            bar.set_postfix_str(f"{best.match.rule} {best_ratio}")
    finally:
        bar.close()
    return SearchResult(current, applied, measured, time.monotonic() - start, stop, steps)


def _best_measured(current: Graph, candidates: list[Candidate], settings: SessionSettings, config: GreedyConfig,
                   deadline: float) -> tuple[Candidate | None, Ratio | None, int]:
    """The candidate with the largest measured speedup over `current` whose interval lies above 1, if any."""
    base_model = current.to_model(static=True)
    best, best_ratio, count = None, None, 0
    for i in range(0, len(candidates), config.batch):
        if time.monotonic() > deadline:
            break
        for candidate, ratio in _measure(base_model, candidates[i: i + config.batch], settings, config, deadline):
            count += 1
            if ratio.faster and (best_ratio is None or ratio.median > best_ratio.median):
                best, best_ratio = candidate, ratio
    return best, best_ratio, count


def _measure(base_model, batch: list[Candidate], settings: SessionSettings, config: GreedyConfig,
             deadline: float) -> list[tuple[Candidate, Ratio]]:
    """Speedups of a batch over the base, interleaved; a candidate onnxruntime cannot run is dropped, not fatal."""
    models = [c.graph.to_model(static=True) for c in batch]
    try:
        comparison = compare([base_model, *models], settings, rounds=config.rounds, seed=config.seed,
                             deadline=deadline)
    except ProviderError as exc:
        if len(batch) == 1:
            log.debug("candidate %s does not run: %s", batch[0].match, exc)
            return []
        return [pair for c in batch for pair in _measure(base_model, [c], settings, config, deadline)]
    return list(zip(batch, comparison.ratios[1:]))
