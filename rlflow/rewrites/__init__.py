"""The rewrite rule library.

`RULES` is the ordered registry (`registry.py`, one line per rule): its order is the action id space of the
environment and the agent, so it is append-only (changing it changes `REGISTRY_VERSION`, which checkpoints record; an
agent trained before rules were appended still acts, on the rules it knows: `rlflow.search.agent.known_rules`).
`PRECISION_RULES`, a table of its own, holds the rules that store a weight in fewer bits: they change what a model
computes, so only `rlflow optimize --precision` offers them.  `GROUPS` sorts the rules by what kind of rewrite they
are.  A rule's code lives in the module of its topic, by concept: `substitutions/` (standard operators into standard
operators: cleanup, layout, algebra, folding, merging), `fusions/` (a subgraph into one operator, and back: norms,
activations, linear layers, embeddings) and `fusions/attention/` (encoder, decoder, grouped-query, rotary, packed
QKV).  `base.py` says what a rule is, `pattern.py` matches rules written as patterns, and `queries.py` and
`edits.py` hold the small graph helpers rules share.

Example:
    >>> import rlflow
    >>> from rlflow.rewrites import RULES, find_matches, apply
    >>> graph = rlflow.load("model.onnx")            # doctest: +SKIP
    >>> matches = find_matches(graph)                # doctest: +SKIP
    >>> better = apply(graph, matches[0])            # doctest: +SKIP
"""
from __future__ import annotations

from typing import Sequence

from rlflow.graph.core import Graph
from rlflow.rewrites import base
from rlflow.rewrites.base import GROUP_NAMES, Match, NoMatch, RewriteError, Rule
from rlflow.rewrites.registry import GROUPS, PRECISION_RULES, REGISTRY_VERSION, RULES


def find_matches(graph: Graph, rules: Sequence[Rule] = RULES) -> list[Match]:
    """Every match of every rule in `graph` (pure), in rule order then node order."""
    return base.find_matches(graph, rules)


def apply(graph: Graph, match: Match, rules: Sequence[Rule] = RULES) -> Graph:
    """A new graph with `match` applied; `graph` is left untouched."""
    return base.apply(graph, match, rules)


def apply_all(graph: Graph, matches: Sequence[Match], rules: Sequence[Rule] = RULES) -> tuple[Graph, list[Match]]:
    """A new graph with each of `matches` that still holds applied in turn, and those applied; `graph` is untouched."""
    return base.apply_all(graph, matches, rules)


def apply_everywhere(graph: Graph, rule: Rule, matches: Sequence[Match], rules: Sequence[Rule] = RULES,
                     deadline: float | None = None) -> tuple[Graph, list[Match]]:
    """A new graph with `rule` applied at `matches` and wherever else it then matches, and the rewrites applied."""
    return base.apply_everywhere(graph, rule, matches, rules, deadline)


def match_counts(graph: Graph, rules: Sequence[Rule] = RULES) -> dict[str, int]:
    """How many matches each rule has in `graph` (every rule listed, zeros included), in rule order."""
    return {r.name: len(r.find(graph)) for r in rules}


def rule(name: str) -> Rule:
    """The rule with this name."""
    for candidate in RULES + PRECISION_RULES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no rule named {name!r}")


__all__ = ["RULES", "PRECISION_RULES", "GROUPS", "REGISTRY_VERSION", "GROUP_NAMES", "Match", "NoMatch", "Rule",
           "RewriteError", "find_matches", "apply", "apply_all", "apply_everywhere", "match_counts", "rule"]
