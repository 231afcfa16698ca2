"""How a search chooses among its candidates: measured end to end against the base graph (`measure_against`,
`select_measured`) or by the cost model's estimate (`select_estimated`), with the time a measurement needs kept in
reserve (`measurement_reserve`).

Time limits hold to within one step that cannot be interrupted: a rewrite or cost estimate, or a measurement that runs
longer than its `Pace` predicted (a session build varies by a second or two on the largest zoo models).  So no
measurement is started that is predicted to end after the deadline; the candidates it would have covered are reported
as not measured (docs/measurement.md).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import onnx

from rlflow.errors import ProviderError
from rlflow.graph.core import Graph
from rlflow.measure.memory import candidates_that_fit
from rlflow.measure.profile_comparison import compare_profiled, profile_count
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace, Ratio, compare, probe
from rlflow.search.candidates import Candidate, SearchResult, dropped

log = logging.getLogger("rlflow")


@dataclass
class Screening:
    """What `measure_against` found: (candidate, speedup) pairs, how many candidates time left unmeasured, and the
    candidates onnxruntime could not run, with its message."""

    pairs: list[tuple[Candidate, Ratio]]
    unmeasured: int = 0
    dropped: list[tuple[Candidate, str]] = field(default_factory=list)


def measure_against(base: Graph, candidates: Sequence[Candidate], settings: SessionSettings, *, rounds: int,
                    seed: int, deadline: float | None = None, batch: int = 6, pace: Pace | None = None) -> Screening:
    """Speedup of each candidate over `base`, measured interleaved in batches (smaller where memory is short).

    A candidate that onnxruntime cannot run is dropped (logged), not fatal.  With a `deadline`, a batch shrinks to
    what `pace` predicts ends before it, and none starts when not even one candidate would; the pace learns from every
    batch, and from a probe of `base` when it has seen nothing yet.
    """
    pending = list(candidates)
    if not pending or (deadline is not None and time.monotonic() > deadline):
        return Screening([], len(pending))
    pace = pace if pace is not None else Pace()
    most = candidates_that_fit(base, batch)
    with pace.timed("export"):
        base_model = base.to_model(static=True)
    if deadline is not None and not pace.known:
        _probe(base_model, settings, pace, seed)
    out: list[tuple[Candidate, Ratio]] = []
    refused: list[tuple[Candidate, str]] = []
    alone = 0  # candidates to measure one at a time: the members of a batch onnxruntime refused
    while pending:
        size = affordable(pace, 1 if alone else min(most, len(pending)), deadline, profiles=profile_count(base))
        if not size:
            break
        chunk, pending, alone = pending[:size], pending[size:], max(0, alone - size)
        try:
            out += _measure_batch(base, base_model, chunk, settings, rounds, seed, deadline, pace)
        except ProviderError as exc:
            if len(chunk) == 1:
                log.debug("candidate %s does not run: %s", chunk[0].applied, exc)
                refused.append((chunk[0], str(exc)))
            else:
                pending, alone = chunk + pending, len(chunk)
    return Screening(out, len(pending), refused)


def affordable(pace: Pace, wanted: int, deadline: float | None, profiles: int = 1) -> int:
    """How many candidates, at most `wanted`, one batch can measure against the base before `deadline` (a batch is
    measured once per shape profile)."""
    if deadline is None:
        return wanted
    left = deadline - time.monotonic()
    return next((n for n in range(wanted, 0, -1) if profiles * pace.block_seconds(n + 1, exports=n) <= left), 0)


RESERVE_SHARE = 0.25
"""Share of its time limit a cost-model search keeps for its final measurement at least."""

RESERVE_SLACK = 1.2
"""Factor on the predicted measurement of one candidate when that sets the reserve: the expansion ends up to one
rewrite and one estimate after its deadline and exports vary, and the reserve must not miss its candidate by that."""


def measurement_reserve(graph: Graph, settings: SessionSettings, time_limit: float, pace: Pace,
                        seed: int = 0) -> float:
    """Seconds a cost-model search keeps for its final measurement: RESERVE_SHARE of its limit, or what measuring one
    candidate against `graph` takes (with RESERVE_SLACK) if that is more, as a probe of `graph` into `pace` shows.

    A fixed share is too little on a large model (BERT-base: about 19 s for one candidate, 65 s for six), which would
    leave the search nothing it can measure in time.
    """
    with pace.timed("export"):
        model = graph.to_model(static=True)
    _probe(model, settings, pace, seed)
    return max(RESERVE_SHARE * time_limit, RESERVE_SLACK * pace.block_seconds(2, exports=2))


def _probe(model: onnx.ModelProto, settings: SessionSettings, pace: Pace, seed: int) -> None:
    """`probe`, but a model onnxruntime cannot run leaves the pace as it was: measuring it will fail on its own."""
    try:
        probe(model, settings, pace, seed=seed)
    except ProviderError as exc:
        log.debug("cannot probe the base model: %s", exc)


def _measure_batch(base: Graph, base_model: onnx.ModelProto, batch: list[Candidate], settings: SessionSettings,
                   rounds: int, seed: int, deadline: float | None, pace: Pace) -> list[tuple[Candidate, Ratio]]:
    """One interleaved comparison of the batch with the base (one per shape profile of the base).

    Raises:
        ProviderError: onnxruntime cannot build or run one of the models.
    """
    if profile_count(base) > 1:
        measured = compare_profiled([base, *(c.graph for c in batch)], settings, rounds=rounds, seed=seed,
                                    deadline=deadline, pace=pace)
        return list(zip(batch, measured.ratios[1:]))
    models = []
    for candidate in batch:
        with pace.timed("export"):
            models.append(candidate.graph.to_model(static=True))
    comparison = compare([base_model, *models], settings, rounds=rounds, seed=seed, deadline=deadline, pace=pace)
    return list(zip(batch, comparison.ratios[1:]))


def fastest(measured: Sequence[tuple[Candidate, Ratio]]) -> tuple[Candidate, Ratio] | None:
    """The candidate with the largest median speedup among those whose interval lies above 1."""
    faster = [pair for pair in measured if pair[1].faster]
    return max(faster, key=lambda pair: pair[1].median) if faster else None


def select_measured(original: Graph, pool: Sequence[Candidate], settings: SessionSettings, *, rounds: int, seed: int,
                    deadline: float | None, start: float, stop_reason: str, estimated: int,
                    pace: Pace | None = None) -> SearchResult:
    """The end of a cost-model search: measure the pool against the original and keep the fastest, if any is faster.

    The stop reason says when time left candidates unmeasured; with none measured, the original is kept.
    """
    screening = measure_against(original, pool, settings, rounds=rounds, seed=seed, deadline=deadline, pace=pace)
    measured = screening.pairs
    best = fastest(measured)
    if not pool:
        outcome = "no rewrite reached a new graph: nothing to measure"
    elif screening.unmeasured and not measured:
        outcome = f"no time left to measure any of {len(pool)} candidates"
    else:
        late = f" ({screening.unmeasured} of {len(pool)} not measured: no time left)" if screening.unmeasured else ""
        outcome = (f"best of {len(measured)} measured{late}: {best[1]}" if best else
                   f"no candidate measurably faster{late}")
    late = ([f"measurement: {screening.unmeasured} of {len(pool)} candidates not measured end to end before the "
             "limit"] if screening.unmeasured else [])
    refused = [dropped(c, error) for c, error in screening.dropped]
    if best is None:
        return SearchResult(original, [], len(measured), time.monotonic() - start, f"{stop_reason}; {outcome}",
                            candidates_estimated=estimated, candidates_unmeasured=screening.unmeasured,
                            not_reached=late, candidates_dropped=refused)
    candidate = best[0]
    steps = [{"rule": m.rule, "location": m.root} for m in candidate.applied]
    return SearchResult(candidate.graph, list(candidate.applied), len(measured), time.monotonic() - start,
                        f"{stop_reason}; {outcome}", steps, estimated, screening.unmeasured, late,
                        candidates_dropped=refused)


def select_estimated(original: Graph, scored: Sequence[tuple[float, Candidate]], original_cost: float, *,
                     start: float, stop_reason: str, estimated: int) -> SearchResult:
    """The end of a cost-model search that measures nothing (`measure=False`: a provider this machine lacks, scored
    by its shipped table and estimate): the graph the cost model prices lowest, where it is below the original."""
    cost, candidate = min(scored, key=lambda pair: pair[0], default=(original_cost, None))
    if candidate is None or cost >= original_cost:
        return SearchResult(original, [], 0, time.monotonic() - start,
                            f"{stop_reason}; no graph estimated faster (nothing measured)",
                            candidates_estimated=estimated)
    steps = [{"rule": m.rule, "location": m.root} for m in candidate.applied]
    return SearchResult(candidate.graph, list(candidate.applied), 0, time.monotonic() - start,
                        f"{stop_reason}; estimated {original_cost / cost:.3f}x by the cost model (nothing measured)",
                        steps, estimated)


def measuring_until(cost_model, deadline: float | None):
    """`cost_model.measuring_until(deadline)`, or nothing for a cost model without one (any object with `graph_cost`
    and `save` serves a search)."""
    limit = getattr(cost_model, "measuring_until", None)
    return limit(deadline) if limit is not None else contextlib.nullcontext()


def coverage(cost_model) -> dict | None:
    """`cost_model.coverage()`, or None for a cost model without one."""
    report = getattr(cost_model, "coverage", None)
    return report() if report is not None else None


def cost_table_lines(coverage: dict | None) -> list[str]:
    """The `not_reached` sentence for a cost table the limit left unfilled (`CostModel.coverage`), or none."""
    if not coverage or not coverage["estimated"]:
        return []
    cached = f", {coverage['table']} were in the table" if coverage["table"] else ""
    return [f"cost table: {coverage['measured']} of {coverage['groups'] - coverage['table']} new operator groups "
            f"measured before the limit{cached}; the other {coverage['estimated']} estimated from their size "
            f"({coverage['estimate']})"]
