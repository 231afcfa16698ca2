"""Where a rule matches in locations of several kinds: its matches grouped by what tells them apart (parameters,
operators and shapes), and the candidates that apply it at one kind of location at a time (greedy's last phase).

A network repeats its layers, and the locations a rule finds in them are of one kind: one decision holds for all of
them, and one location's share of their gain is below what a measurement resolves where theirs together was not."""
from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

from rlflow.graph.core import Graph
from rlflow.rewrites import RULES, Match, Rule, apply_all, find_matches
from rlflow.search.candidates import Candidate

log = logging.getLogger("rlflow")


def location_kind(nodes: dict, match: Match) -> tuple:
    """What tells `match`'s location from the rule's other locations: its parameters and its nodes' operators and the
    shapes they read and write (`nodes`: the graph's `node_map`).  A network's repeated layers are locations of one
    kind, and want one decision."""
    def shapes(tensors) -> tuple:
        return tuple(None if t.shape is None else tuple(t.shape) for t in tensors)

    return match.params, tuple((nodes[name].op, shapes(nodes[name].inputs), shapes(nodes[name].outputs))
                               for name in match.nodes)


def kinds_of_location(graph: Graph, matches: Sequence[Match]) -> dict[str, list[list[Match]]]:
    """Per rule among `matches`, its matches grouped by `location_kind`, the largest group first."""
    nodes = graph.node_map()
    groups: dict[str, dict[tuple, list[Match]]] = {}
    for match in matches:
        groups.setdefault(match.rule, {}).setdefault(location_kind(nodes, match), []).append(match)
    return {rule: sorted(kinds.values(), key=len, reverse=True) for rule, kinds in groups.items()}


def alike(parent: Candidate, rules: Sequence[Rule] = RULES, seen: set[str] | None = None,
          deadline: float | None = None, matches: Sequence[Match] | None = None) -> Iterator[Candidate]:
    """For each rule whose locations in `parent` are of several kinds (`location_kind`): the graph with it applied at
    the locations of one kind, a candidate per kind, the kinds with the most locations first.

    What is left to try once a rule applied everywhere is not measurably faster: applied at all its locations it may
    gain at some kinds and lose at others.  One location of a kind is not tried alone: it gains what the kind's
    locations gain together divided by their number, against the same noise, so it is faster only where they are
    (on a 30-layer decoder step that is 14 candidates, where the single rewrites were 826).
    """
    seen = seen if seen is not None else {parent.fingerprint}
    matches = find_matches(parent.graph, rules) if matches is None else matches
    kinds = [group for groups in kinds_of_location(parent.graph, matches).values() if len(groups) > 1
             for group in groups]
    for group in sorted(kinds, key=len, reverse=True):
        if deadline is not None and time.monotonic() > deadline:
            return
        try:
            graph, applied = apply_all(parent.graph, group, rules)
        except Exception as exc:  # noqa: BLE001 - one faulty rule must never stop a search (`try_apply`)
            log.debug("skipping %s at %d locations: %s", group[0].rule, len(group), exc)
            continue
        fingerprint = graph.fingerprint()
        if not applied or fingerprint in seen:
            continue
        seen.add(fingerprint)
        yield Candidate(graph, parent.applied + tuple(applied), fingerprint)
