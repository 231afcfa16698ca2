"""Greedy search: apply the rewrite with the best measured gain, repeat until no rewrite is measurably faster.

A step measures its candidates in batches (`phases`): every fusion applied everywhere at once; then each rule that
matches in several places applied at all of them (`everywhere`); then, if none of those is faster, each rule at the
locations of each kind (`alike`: same operators and shapes).  The layers of a network usually want the same decision,
and together their gain stands out of the measurement's noise.

A rewrite measured and not faster at one step is not measured again at a later one while it is the very same rewrite
(the same matches: the step changed another part of the graph), as lazy greedy algorithms do: a gain seldom appears
where an unrelated part of the graph changed, and on a 752-node decoder step the second step measuring again what the
first had refused ran greedy out of time.  What a step makes possible is new and measured: every fusion at once
changes with each fusion step, and rules matching the new nodes are new matches.

A step is taken on one measurement: measuring the fastest again before stepping (against the dozen candidates a batch
screens at 95% each) lost true steps to noise on the small BERTs.  But a step
never undoes an earlier step of one rule: a rewrite of the other direction (an inverse rule after a fusion or a merge,
a fusion or a merge after an inverse) on nodes that step made is not measured.  Both measured faster means one of the
two was noise, and on the decode steps greedy otherwise went round in circles (rotary fused, then unfused;
skip-RMSNorm unfused, one re-fused, RMSNorm unfused and fused again), each step "faster", the gate finding nothing.
The nodes of a step of several rules (every fusion at once) may be undone: every fusion but one kind is a true step
on the encoders (skip-LayerNormalization, docs/agents.md)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from itertools import chain, islice
from typing import Callable, Iterator, Sequence

from tqdm import tqdm

from rlflow.graph.core import Graph
from rlflow.measure.memory import shares_weights
from rlflow.measure.profile_comparison import profile_count
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import Profile
from rlflow.measure.timing import Pace, Ratio
from rlflow.rewrites import GROUPS, RULES, Rule, find_matches
from rlflow.search.candidates import Candidate, SearchResult, all_fusions, children, dropped, everywhere, rule_names
from rlflow.search.frozen_heap import frozen_heap
from rlflow.search.location_kinds import alike, kinds_of_location
from rlflow.search.selection import affordable, fastest, measure_against


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


LARGE_MODEL_CANDIDATES = 2
"""Candidates built per batch at most for a model whose weights are shared between sessions (`shares_weights`): a
candidate holds its rewritten weights, and building all of GPT-2 large's single rewrites at once took 11 GiB (4 per
batch: a 9.2 GiB peak for 2.9 GiB of weights; 2: see docs/measurement.md)."""


def phases(current: Candidate, rules: Sequence[Rule], seen: set[str], deadline: float,
           most: int | Callable[[], int | None] | None = None) -> Iterator[list[Candidate]]:
    """A step's candidates in batches, each measured only when none of the one before was measurably faster: every
    fusion applied everywhere at once (`all_fusions`); each rule applied everywhere it matches (those matching in
    the most places first: on a 1 GB decoder only a few candidates fit in the time, and a TorchScript export's 310
    no-op Casts are worth more than a rule matching twice), with the rules that match once; each rule at the
    locations of each kind, where it has several (`alike`).  `most`: candidates built per batch at most (or what a
    function says before each batch); a phase then comes in as many batches as it has (it once stopped at its first:
    on a 1 GB decoder greedy measured two cleanup rules and never reached a fusion).

    Making a candidate costs a copy of the graph, and measuring one a session: on a 600-1300-node transformer the
    hundred-odd single rewrites greedy once tried last took most of a 60 s limit before anything was measured, where
    all fusions at once is one candidate that usually wins the step.
    """
    matches = find_matches(current.graph, rules)
    counts = Counter(m.rule for m in matches)
    once = [r for r in rules if counts[r.name] == 1]
    fused = all_fusions(current, rules, seen, deadline)
    if fused is not None:
        yield [fused]
    widest = sorted(rules, key=lambda r: -counts[r.name])  # where only a few batches fit, the widest rules first
    yield from _batches(chain(everywhere(current, widest, seen, deadline, matches),
                              children(current, once, seen, deadline)), most)
    yield from _batches(alike(current, rules, seen, deadline, matches), most)


def step_size(graph: Graph, rules: Sequence[Rule] = RULES) -> int:
    """Candidates a greedy step from `graph` builds at most (`phases`), when none of them is faster: all fusions at
    once, each matching rule everywhere (or at its one place), and each kind of location of the rules with several
    kinds.  What the default time limit lets greedy measure, so that it ends by finding none faster, not by time."""
    matches = find_matches(graph, rules)
    kinds = kinds_of_location(graph, matches)
    fusions = sum(1 for r in rules if r in GROUPS["fusion"] and r.name in kinds)
    return int(fusions > 1) + len(kinds) + sum(len(groups) for groups in kinds.values() if len(groups) > 1)


def _batches(candidates: Iterator[Candidate],
             most: int | Callable[[], int | None] | None) -> Iterator[list[Candidate]]:
    """`candidates` in lists of `most` (all in one where None), each built only when the one before was measured."""
    while batch := list(islice(candidates, most() if callable(most) else most)):
        yield batch


_AT_EVERY_PROFILE = " (on the profiles' weighted mean and slower at none of them)"


def greedy(graph: Graph, settings: SessionSettings, config: GreedyConfig | None = None,
           rules: Sequence[Rule] = RULES, progress: bool = False) -> SearchResult:
    """Greedy search over `rules`, measuring candidates end to end on `settings.provider`."""
    config = config or GreedyConfig()
    start = time.monotonic()
    deadline = start + config.time_limit
    current = Candidate(graph, (), graph.fingerprint())
    seen = {current.fingerprint}
    steps, measured, unmeasured, stop, refused = [], 0, 0, "step limit", []
    pace = Pace()  # shared by the steps: every step's candidates are about the size of the input
    most = LARGE_MODEL_CANDIDATES if shares_weights(graph) else None

    starved = False  # a batch was due and the time left could measure none of it
    refused_before: set[frozenset] = set()  # rewrites measured not faster at an earlier step, by their matches
    made: dict[str, bool] = {}  # node -> whether the one-rule step that made it undid (True) or fused or merged (False)
    direction = {r.name: r.group == "inverse" for r in rules if r.group in ("inverse", "fusion", "merge")}

    def batch_size() -> int | None:
        """Candidates worth building for the next batch: `most`, but no more than the time left can measure (a 30-layer
        decoder's dozen rules applied everywhere took 12 s to build, and the time left measured four of them)."""
        nonlocal starved
        wanted = most or config.max_candidates
        fits = affordable(pace, wanted, deadline, profiles=profile_count(graph)) if pace.known else wanted
        starved = fits == 0
        return most if fits >= wanted else fits

    # the heap held before the search out of the collector's rescans while candidates are built (`frozen_heap`)
    with tqdm(total=config.max_steps, desc="greedy", unit="step", disable=not progress, leave=False) as bar, \
            frozen_heap():
        for _ in range(config.max_steps):
            if time.monotonic() > deadline:
                stop = "time limit"
                break
            best, tried, closest = None, False, None
            for candidates in phases(current, rules, seen, deadline, batch_size):
                tried = tried or bool(candidates)
                candidates = [c for c in candidates if _rewrite(c, current) not in refused_before
                              and not _undoes(c, current, made, direction)]
                candidates.sort(key=lambda c: len(c.graph))  # fewer nodes first: the cheapest ranking before measuring
                results = measure_against(current.graph, candidates[: config.max_candidates], settings,
                                          rounds=config.rounds, seed=config.seed, deadline=deadline, pace=pace)
                refused_before.update(_rewrite(c, current) for c, ratio in results.pairs if not ratio.faster)
                measured += len(results.pairs)
                unmeasured = results.unmeasured
                refused += [dropped(c, error, since=len(current.applied)) for c, error in results.dropped]
                best = fastest(results.pairs)
                closest = max(results.pairs + ([closest] if closest else []), key=lambda p: p[1].median, default=None)
                if best is not None or time.monotonic() > deadline:
                    break
            if best is None:
                unmeasured = max(unmeasured, int(starved))
                if unmeasured or time.monotonic() > deadline:
                    stop = "time limit"
                elif not tried:
                    stop = "no rewrite applies"
                else:
                    stop = ("no rewrite is measurably faster" + (_AT_EVERY_PROFILE if len(graph.profiles) > 1 else "")
                            + (f"; the closest: {_closest(closest, current, graph.profiles)}" if closest else ""))
                break
            unmeasured = 0
            step = best[0].applied[len(current.applied):]
            if len({m.rule for m in step}) == 1 and step[0].rule in direction:
                made.update(dict.fromkeys(_made(current.graph, best[0].graph), direction[step[0].rule]))
            current, ratio = best
            steps.append({"rule": rule_names(step), "location": step[0].root,
                          "step_speedup": ratio.as_dict(), "nodes": len(current.graph), "rewrites": len(step)})
            bar.update(1)
            bar.set_postfix_str(f"{steps[-1]['rule']} {ratio}")
    return SearchResult(current.graph, list(current.applied), measured, time.monotonic() - start, stop, steps,
                        candidates_unmeasured=unmeasured, candidates_dropped=refused)


def _made(before: Graph, after: Graph) -> set[str]:
    """The names of the nodes in `after` that `before` lacks (rewrites keep the names of the nodes they leave)."""
    return {n.name for n in after.gs.nodes} - {n.name for n in before.gs.nodes}


def _undoes(candidate: Candidate, base: Candidate, made: dict[str, bool], direction: dict[str, bool]) -> bool:
    """Whether a rewrite of `candidate` (beyond `base`) takes nodes a one-rule step made with a rule of the other
    direction (`direction`: rule -> undoes (an inverse) or not (a fusion or a merge); `made`: node -> the direction
    of the step that made it).  Rules of neither direction (cleanups, layout, algebra) undo nothing."""
    for match in candidate.applied[len(base.applied):]:
        undoing = direction.get(match.rule)
        if undoing is not None and any(made.get(node, undoing) != undoing for node in match.nodes):
            return True
    return False


def _closest(pair: tuple[Candidate, Ratio], base: Candidate, profiles: Sequence[Profile]) -> str:
    """The candidate that came closest to a step, as the stop reason names it: its rules and speedup, and the profile
    where it was slower when that is what refused it (its interval may lie above 1 on the profiles' mean)."""
    candidate, ratio = pair
    slower = getattr(ratio, "slower_at", ())
    rules = rule_names(candidate.applied[len(base.applied):])
    return f"{rules} {ratio}" + (f", slower at {profiles[slower[0]].label}" if slower else "")


def _rewrite(candidate: Candidate, base: Candidate) -> frozenset:
    """What `candidate` does to `base`: the matches it applies, which name the nodes they rewrite."""
    return frozenset(candidate.applied[len(base.applied):])
