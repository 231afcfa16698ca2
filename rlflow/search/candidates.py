"""One step of any search: every graph reachable by a single rewrite, deduplicated by fingerprint."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from rlflow.graph import Graph
from rlflow.rewrites import RULES, Match, Rule, apply, find_matches

log = logging.getLogger("rlflow")


@dataclass
class Candidate:
    """A graph one rewrite away from its parent."""

    graph: Graph
    match: Match
    fingerprint: str


def expand(graph: Graph, rules: Sequence[Rule] = RULES, seen: set[str] | None = None) -> list[Candidate]:
    """Applies every match of `rules` to `graph`; graphs already in `seen` (fingerprints) are skipped and added.

    A rewrite that fails (raises) is logged and skipped: one faulty rule must never stop a search.
    """
    seen = seen if seen is not None else {graph.fingerprint()}
    out = []
    for match in find_matches(graph, rules):
        try:
            child = apply(graph, match, rules)
        except Exception as exc:  # noqa: BLE001 - see docstring
            log.debug("skipping %s: %s", match, exc)
            continue
        fingerprint = child.fingerprint()
        if fingerprint in seen:
            continue
        seen.add(fingerprint)
        out.append(Candidate(child, match, fingerprint))
    return out
