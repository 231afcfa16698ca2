"""The rewrite rule library.

`RULES` is the ordered registry: its order is the action id space of the environment and the agent, so it is
append-only (changing it changes `REGISTRY_VERSION`, which checkpoints record; an agent trained before rules were
appended still acts, on the rules it knows: `rlflow.search.agent.known_rules`).

Example:
    >>> import rlflow
    >>> from rlflow.rewrites import RULES, find_matches, apply
    >>> graph = rlflow.load("model.onnx")            # doctest: +SKIP
    >>> matches = find_matches(graph)                # doctest: +SKIP
    >>> better = apply(graph, matches[0])            # doctest: +SKIP
"""
from __future__ import annotations

from typing import Sequence

from rlflow.graph import Graph
from rlflow.rewrites import algebra, attention, base, cleanup, embedding, fold, fusion, inverse, layout, merge
from rlflow.rewrites.base import CATEGORIES, Match, NoMatch, RewriteError, Rule, registry_version

RULES: tuple[Rule, ...] = (
    layout.TransposeTranspose(),
    fold.ConvBatchNorm(),
    *cleanup.RULES,
    *layout.RULES,
    *algebra.RULES,
    *fold.RULES,
    *merge.RULES,
    *fusion.RULES,
    # -- appended after the first release (action ids 68 on)
    *layout.NEW_RULES,
    *fusion.NEW_RULES,
    *attention.RULES,
    *inverse.RULES,
    # -- appended with the deployment section (issue 24)
    *attention.NEW_RULES,
    *embedding.RULES,
)
"""Every rule, in action-id order.  Append only."""

_INVERSE = frozenset({r.name for r in inverse.RULES} | {"gemm-to-matmul-add"})
GROUPS: dict[str, tuple[Rule, ...]] = {
    "merge": tuple(r for r in RULES if r.category == "merge" and r.name not in _INVERSE),
    "algebra": tuple(r for r in RULES if r.category == "algebra"),
    "fold": tuple(r for r in RULES if r.category in ("fold", "cleanup")),
    "layout": tuple(r for r in RULES if r.category == "layout" and r.name not in _INVERSE),
    "fusion": tuple(r for r in RULES if r.category == "fusion" and r.name not in _INVERSE),
    "inverse": tuple(r for r in RULES if r.name in _INVERSE),
}
"""The six groups of the rule library's specification (issue 3): merging parallel work, algebra, folding (cleanup
included), layout, onnxruntime-aware fusions, and inverse rules (split a merged operator, undo a fusion) that let a
sequence pass through a slower graph.  Every rule is in exactly one group."""

REGISTRY_VERSION = registry_version(RULES)

_names = [r.name for r in RULES]
if len(set(_names)) != len(_names):
    raise TypeError(f"duplicate rule names in RULES: {sorted(n for n in _names if _names.count(n) > 1)}")


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
    for candidate in RULES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no rule named {name!r}")


__all__ = ["RULES", "GROUPS", "REGISTRY_VERSION", "CATEGORIES", "Match", "NoMatch", "Rule", "RewriteError", "find_matches",
           "apply", "apply_all", "apply_everywhere", "match_counts", "rule"]
