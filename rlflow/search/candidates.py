"""What every search expands: a candidate (a graph and the rewrites that made it), one-rewrite children
(deduplicated), a rule applied everywhere, every fusion at once, and what a search hands back (`SearchResult`).
Choosing among candidates, by measurement or by estimate, is `rlflow.search.selection`'s.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from rlflow.graph.core import Graph
from rlflow.rewrites import GROUPS, RULES, Match, Rule, apply, apply_everywhere, find_matches

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
        candidates_unmeasured: graphs the search would have measured but had no time left for (a longer limit might
            have found more).
        not_reached: what the time limit left undone, one sentence each (empty when the search finished its work).
        cost_table: where the cost model's group costs came from while the search ran (`CostModel.coverage`), for a
            search that uses one.
        candidates_dropped: candidates onnxruntime could not run, so never measured (`dropped`), one dict each.
    """

    graph: Graph
    applied: list[Match]
    candidates_measured: int
    seconds: float
    stop_reason: str
    steps: list[dict] = field(default_factory=list)
    candidates_estimated: int = 0
    candidates_unmeasured: int = 0
    not_reached: list[str] = field(default_factory=list)
    cost_table: dict | None = None
    candidates_dropped: list[dict] = field(default_factory=list)


def rule_names(matches: Iterable[Match]) -> str:
    """The rules of `matches`, each once and in order, as reports name a step."""
    return ", ".join(dict.fromkeys(m.rule for m in matches))


def dropped(candidate: Candidate, error: str, since: int = 0) -> dict:
    """A candidate onnxruntime could not run, as reports show it: the rules of its rewrites after the first `since`
    (those the step that made it added) and onnxruntime's message.  On CUDA with graph capture this is how a rewrite
    that puts a node on the CPU shows: the capture is refused."""
    return {"rules": rule_names(candidate.applied[since:]), "error": " ".join(error.split())[:300]}


def try_apply(graph: Graph, match: Match, rules: Sequence[Rule]) -> Graph | None:
    """`apply`, but a rewrite that fails is logged and skipped: one faulty rule must never stop a search."""
    try:
        return apply(graph, match, rules)
    except Exception as exc:  # noqa: BLE001 - see docstring
        log.debug("skipping %s: %s", match, exc)
        return None


def children(parent: Candidate | Graph, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
             deadline: float | None = None) -> Iterator[Candidate]:
    """Every graph one rewrite away from `parent`, one at a time; fingerprints already in `seen` are skipped, new ones
    added.  No rewrite starts after `deadline`.

    One at a time, so that a search can estimate each child as it comes: on a large graph one expansion can take the
    whole time limit (nasnet-a-mobile: about 45 s), and children made but not yet estimated at the deadline are lost.
    """
    if isinstance(parent, Graph):
        parent = Candidate(parent, (), parent.fingerprint())
    seen = seen if seen is not None else {parent.fingerprint}
    for match in find_matches(parent.graph, rules):
        if deadline is not None and time.monotonic() > deadline:
            return
        child = try_apply(parent.graph, match, rules)
        if child is None:
            continue
        fingerprint = child.fingerprint()
        if fingerprint in seen:
            continue
        seen.add(fingerprint)
        yield Candidate(child, parent.applied + (match,), fingerprint)


def expand(parent: Candidate | Graph, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
           deadline: float | None = None) -> list[Candidate]:
    """`children` as a list."""
    return list(children(parent, rules, seen, deadline))


def distinct(candidates: Sequence[Candidate]) -> list[Candidate]:
    """`candidates` without the graphs met earlier in it (a rollout may end on a fuse-everything graph)."""
    seen: set[str] = set()
    return [c for c in candidates if not (c.fingerprint in seen or seen.add(c.fingerprint))]


def everywhere(parent: Candidate, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
               deadline: float | None = None, matches: Sequence[Match] | None = None) -> Iterator[Candidate]:
    """For each rule that matches `parent` in two places or more: the graph with it applied wherever it matches.

    A network repeats its layers, so one decision usually holds for all of them; and the gain of fusing every layer's
    attention is what a measurement can tell from noise, where one layer's (1-3% of a small transformer) is not.
    `matches`: those of `rules` in `parent`, when the caller has found them already.
    """
    seen = seen if seen is not None else {parent.fingerprint}
    by_rule = {rule.name: [] for rule in rules}
    for match in find_matches(parent.graph, rules) if matches is None else matches:
        by_rule[match.rule].append(match)
    for rule in rules:
        if deadline is not None and time.monotonic() > deadline:
            return
        if len(by_rule[rule.name]) < 2:
            continue
        graph, applied = apply_everywhere(parent.graph, rule, by_rule[rule.name], rules, deadline)
        fingerprint = graph.fingerprint()
        if len(applied) < 2 or fingerprint in seen:
            continue
        seen.add(fingerprint)
        yield Candidate(graph, parent.applied + tuple(applied), fingerprint)


ALL_FUSIONS_ROUNDS = 8
"""Passes over the fusion rules at most in `all_fusions` (a decoder's chain is three deep: rotary and attention, then
the rotary absorbed, then Q/K/V packed)."""


def all_fusions(parent: Candidate, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
                deadline: float | None = None) -> Candidate | None:
    """`parent` with every fusion rule among `rules` applied everywhere it matches, until none matches; None when that
    is no new graph, or when fewer than two rules took part (`everywhere` makes those).

    What onnxruntime's transformers optimizer does in one go: on a transformer each fusion alone gains 1-3%, within a
    short measurement's noise, where all of them together stand out.  Later rules of the registry build on earlier
    ones' output (packed QKV on fused attention, bias-GELU on a MatMul's bias), so the rules go in reverse order, and
    around again while any of them matched.
    """
    fusions = [rule for rule in reversed(rules) if rule in GROUPS["fusion"]]
    graph, applied, used = parent.graph, list(parent.applied), set()
    for _ in range(ALL_FUSIONS_ROUNDS):
        before = len(applied)
        for rule in fusions:
            matches = rule.find(graph)
            if matches:
                graph, done = apply_everywhere(graph, rule, matches, rules, deadline)
                applied += done
                used.update(m.rule for m in done)
        if len(applied) == before or (deadline is not None and time.monotonic() > deadline):
            break
    fingerprint = graph.fingerprint()
    if len(used) < 2 or (seen is not None and fingerprint in seen):
        return None
    if seen is not None:
        seen.add(fingerprint)
    return Candidate(graph, tuple(applied), fingerprint)
