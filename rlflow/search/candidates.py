"""Pieces every search shares: one-rewrite expansion (deduplicated) and end-to-end selection among candidates."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import onnx

from rlflow.errors import ProviderError
from rlflow.graph import Graph
from rlflow.measure.memory import candidates_that_fit
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Ratio, compare
from rlflow.rewrites import RULES, Match, Rule, apply, find_matches

log = logging.getLogger("rlflow")


@dataclass
class Candidate:
    """A graph reached from the search's start by a sequence of rewrites."""

    graph: Graph
    applied: tuple[Match, ...]
    fingerprint: str

    @property
    def match(self) -> Match:
        """The last rewrite applied."""
        return self.applied[-1]


@dataclass
class SearchResult:
    """What a search found: the best graph, the rewrites that led to it and what it cost.

    Attributes:
        candidates_measured: graphs measured end to end (the expensive, real measurements).
        candidates_estimated: graphs scored with the cost model only.
    """

    graph: Graph
    applied: list[Match]
    candidates_measured: int
    seconds: float
    stop_reason: str
    steps: list[dict] = field(default_factory=list)
    candidates_estimated: int = 0


def try_apply(graph: Graph, match: Match, rules: Sequence[Rule]) -> Graph | None:
    """`apply`, but a rewrite that fails is logged and skipped: one faulty rule must never stop a search."""
    try:
        return apply(graph, match, rules)
    except Exception as exc:  # noqa: BLE001 - see docstring
        log.debug("skipping %s: %s", match, exc)
        return None


def expand(parent: Candidate | Graph, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
           deadline: float | None = None) -> list[Candidate]:
    """Every graph one rewrite away from `parent`; fingerprints already in `seen` are skipped, new ones added."""
    if isinstance(parent, Graph):
        parent = Candidate(parent, (), parent.fingerprint())
    seen = seen if seen is not None else {parent.fingerprint}
    out = []
    for match in find_matches(parent.graph, rules):
        if deadline is not None and time.monotonic() > deadline:
            break
        child = try_apply(parent.graph, match, rules)
        if child is None:
            continue
        fingerprint = child.fingerprint()
        if fingerprint in seen:
            continue
        seen.add(fingerprint)
        out.append(Candidate(child, parent.applied + (match,), fingerprint))
    return out


def measure_against(base: Graph, candidates: Sequence[Candidate], settings: SessionSettings, *, rounds: int,
                    seed: int, deadline: float | None = None, batch: int = 6) -> list[tuple[Candidate, Ratio]]:
    """Speedup of each candidate over `base`, measured interleaved in batches (smaller where memory is short).

    A candidate that onnxruntime cannot run is dropped (logged), not fatal.  Stops starting batches after `deadline`.
    """
    batch = candidates_that_fit(base, batch)
    base_model = base.to_model(static=True)
    out = []
    for i in range(0, len(candidates), batch):
        if deadline is not None and time.monotonic() > deadline:
            break
        out += _measure_batch(base_model, list(candidates[i: i + batch]), settings, rounds, seed, deadline)
    return out


def _measure_batch(base_model: onnx.ModelProto, batch: list[Candidate], settings: SessionSettings, rounds: int,
                   seed: int, deadline: float | None) -> list[tuple[Candidate, Ratio]]:
    models = [c.graph.to_model(static=True) for c in batch]
    try:
        comparison = compare([base_model, *models], settings, rounds=rounds, seed=seed, deadline=deadline)
    except ProviderError as exc:
        if len(batch) == 1:
            log.debug("candidate %s does not run: %s", batch[0].applied, exc)
            return []
        return [pair for c in batch for pair in _measure_batch(base_model, [c], settings, rounds, seed, deadline)]
    return list(zip(batch, comparison.ratios[1:]))


def fastest(measured: Sequence[tuple[Candidate, Ratio]]) -> tuple[Candidate, Ratio] | None:
    """The candidate with the largest median speedup among those whose interval lies above 1."""
    faster = [pair for pair in measured if pair[1].faster]
    return max(faster, key=lambda pair: pair[1].median) if faster else None


def select_measured(original: Graph, pool: Sequence[Candidate], settings: SessionSettings, *, rounds: int, seed: int,
                    deadline: float | None, start: float, stop_reason: str, estimated: int) -> SearchResult:
    """The end of a cost-model search: measure the pool against the original and keep the fastest, if any is faster."""
    measured = measure_against(original, pool, settings, rounds=rounds, seed=seed, deadline=deadline)
    best = fastest(measured)
    if best is None:
        return SearchResult(original, [], len(measured), time.monotonic() - start,
                            f"{stop_reason}; no candidate measurably faster", candidates_estimated=estimated)
    candidate, ratio = best
    steps = [{"rule": m.rule, "location": m.root} for m in candidate.applied]
    return SearchResult(candidate.graph, list(candidate.applied), len(measured), time.monotonic() - start,
                        f"{stop_reason}; best of {len(measured)} measured: {ratio}", steps, estimated)
