"""The final input-vs-output measurement of `rlflow optimize`, planned to fit the model's size.

Its interval resamples blocks of rounds, each block with fresh sessions (see `compare`), so what decides whether a
real gain is confirmed is how many blocks it gets.  A fixed plan of 5 blocks of 6 rounds under a fixed deadline gave a
100-350 ms model (RoBERTa-base, MiniLM-L12 at sequence 128) one or two blocks, each mostly session builds and warm-up
runs: gains of 8-13% went unconfirmed.  So the plan here is made from the input's measured session and run times:
fewer rounds per block and fewer warm-up runs before fewer blocks, within a budget that grows with the search's own
time limit (a thorough search is worth a thorough check; the quick default agent keeps GATE_SECONDS), and on a model
slow to load up to what the whole plan takes, where a fixed ceiling left a 1 GiB decoder step two to four blocks
(docs/measurement.md).  A graph measured at several shape profiles splits the budget between them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from rlflow.graph.core import Graph
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import Profile, combine
from rlflow.measure.timing import MIN_ROUNDS, WARMUP_RUNS, Comparison, Pace, Ratio, compare

GATE_SECONDS = 15.0
"""The gate's budget under short search limits (the default agent's 10 s): past it no block or round starts that the
pace predicts would end late, beyond the plan's least (MIN_BLOCKS blocks of MIN_ROUNDS rounds)."""

GATE_MAX_SECONDS = 30.0
"""The budget's ceiling where the whole plan fits under it: it is half the search's time limit between GATE_SECONDS and
this."""

MIN_BLOCKS = 2
"""Blocks the gate always plans: one block's sessions say nothing about how much sessions differ."""

PLAN_MARGIN = 1.25
"""Factor on the plan's predicted seconds in the deadline given to `compare`, so that a session built slower than the
input's first one does not cut the plan's least."""

WARMUP_SECONDS = 0.25
"""Untimed warm-up per session, in runs of at least 2 (a slow model is warm after its first run or two) and at most
WARMUP_RUNS."""


@dataclass(frozen=True)
class GatePlan:
    """Blocks of fresh sessions, timed rounds in each, warm-up runs per session, and the seconds they should take."""

    blocks: int
    rounds_per_block: int
    warmup: int
    seconds: float


def gate_budget(time_limit: float, paces: Sequence[Pace] = (), rounds: int = 30) -> float:
    """Seconds the gate may take after a search limited to `time_limit` seconds: half the limit between GATE_SECONDS
    and GATE_MAX_SECONDS, or, up to half the limit, what the whole plan of `rounds` takes at every profile by the
    input's `paces`.  Fewer blocks are both wider (a real gain goes unconfirmed) and less calibrated (a step called
    faster than itself in placebo trials)."""
    budget = min(GATE_MAX_SECONDS, max(GATE_SECONDS, time_limit / 2))
    whole = sum(plan_gate(pace, rounds, math.inf).seconds for pace in paces)
    return max(budget, min(time_limit / 2, whole))


def warmup_runs(run_seconds: float) -> int:
    return max(2, min(WARMUP_RUNS, math.ceil(WARMUP_SECONDS / max(run_seconds, 1e-9))))


def plan_gate(pace: Pace, rounds: int, budget: float) -> GatePlan:
    """The most of `rounds` (in blocks as `compare` groups them) that the pace predicts fit in `budget` seconds.

    Rounds per block give way first (down to MIN_ROUNDS), then blocks (down to MIN_BLOCKS).
    """
    warmup = warmup_runs(pace.seconds.get("run", 0.0))
    blocks = min(5, max(1, rounds // 6))
    per_block = max(1, rounds // blocks)

    def seconds() -> float:
        return blocks * pace.block_seconds(2, warmup=warmup, rounds=per_block)

    while seconds() > budget and (per_block > MIN_ROUNDS or blocks > MIN_BLOCKS):
        if per_block > MIN_ROUNDS:
            per_block -= 1
        else:
            blocks -= 1
    return GatePlan(blocks, per_block, warmup, seconds())


@dataclass
class Gate:
    """The final measurement: per shape profile of the baseline graph (one entry without profiles), and the speedup
    the decision is made on (the weighted geometric mean over profiles)."""

    comparisons: list[Comparison]
    plans: list[GatePlan]
    profiles: list[Profile]
    ratio: Ratio  # a `CombinedRatio` where there are profiles

    @property
    def slower_at(self) -> list[Profile]:
        """Profiles at which the candidate is measurably slower (`combine` found them)."""
        return [self.profiles[i] for i in self.ratio.slower_at] if self.profiles else []

    @property
    def keep(self) -> bool:
        """Measurably faster overall, and measurably slower at no profile (`CombinedRatio.faster`)."""
        return self.ratio.faster


def measure_gate(baseline: Graph, candidate: Graph, settings: SessionSettings, paces: Sequence[Pace], *,
                 rounds: int, budget: float, seed: int) -> Gate:
    """`compare` of the candidate against the baseline by `plan_gate`, at each profile of the baseline graph, which
    share the budget.  `paces[i]` holds the baseline's session and run times at profile i (`check_and_time`) and
    learns the candidate's as the blocks go."""
    profiles = list(baseline.profiles) or [None]
    comparisons, plans = [], []
    for profile, pace in zip(profiles, paces):
        plan = plan_gate(pace, rounds, budget / len(profiles))
        comparisons.append(compare([export_at(baseline, profile), export_at(candidate, profile)], settings,
                                   rounds=plan.blocks * plan.rounds_per_block, blocks=plan.blocks,
                                   warmup=plan.warmup, seed=seed, labels=["input", "output"], pace=pace,
                                   deadline=time.monotonic() + max(budget / len(profiles),
                                                                    PLAN_MARGIN * plan.seconds)))
        plans.append(plan)
    if profiles == [None]:
        return Gate(comparisons, plans, [], comparisons[0].ratios[1])
    ratio = combine([c.ratios[1] for c in comparisons], [p.weight for p in profiles])
    return Gate(comparisons, plans, profiles, ratio)
