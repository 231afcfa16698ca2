"""Rule, Match and NoMatch: the vocabulary of the rewrite library.

A rule is a small declarative object (as in the onnxscript rewriter and egg): `check` looks at one root node and says
either how to rewrite there (a Match carrying everything `rewrite` needs) or why not (a NoMatch with a reason);
`rewrite` edits a clone of the graph.  Nothing is stored on the rule between the two.
"""
from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence

import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph

log = logging.getLogger("rlflow")

GROUP_NAMES = ("merge", "algebra", "fold", "layout", "fusion", "inverse", "precision")
"""What kind of rewrite a rule is; the registry (`registry.py`) gives each rule one.

merge: parallel work combined into one larger operator; algebra: identities that change the computation; fold:
constants absorbed into weights, and operators that compute nothing removed; layout: transposes, reshapes,
concatenations and splits that cancel or move; fusion: onnxruntime-aware fusions into standard or contrib operators;
inverse: a merged operator split or a fusion undone, so that a sequence can pass through a slower graph to reach a
faster one (as TASO's search does); precision: a weight stored in fewer bits, which changes the computation within
an error budget (`registry.PRECISION_RULES`, never among `RULES`)."""

_KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Match:
    """Where and how a rule applies.

    Attributes:
        rule: the rule's name.
        nodes: names of the nodes the rewrite consumes; the first is the root (the location an agent chooses).
        params: whatever else `rewrite` needs, as plain hashable values (ints, strings, tuples), never arrays, so that
            `rewrite` never has to match again.  A tensor is given by where it sits among the nodes (`Rule.locate`,
            read back with `input`/`output`), a constant by the node input holding it.

    A match is a value: equal matches are interchangeable, it pickles small, and `apply` checks that the rule still
    finds the same match on the graph it edits before it rewrites.
    """

    rule: str
    nodes: tuple[str, ...]
    params: tuple[tuple[str, object], ...] = ()

    def param(self, key: str, default=None):
        """One parameter by name."""
        return dict(self.params).get(key, default)

    @property
    def root(self) -> str:
        """The name of the root node."""
        return self.nodes[0]

    def input(self, key: str, nodes: dict[str, gs.Node]) -> gs.Tensor | None:
        """The tensor that parameter `key` locates as an input (`Rule.locate`), in the graph `nodes` belongs to; None
        when the parameter is None."""
        where = self.param(key)
        return None if where is None else nodes[self.nodes[where[0]]].inputs[where[1]]

    def output(self, key: str, nodes: dict[str, gs.Node]) -> gs.Tensor | None:
        """The tensor that parameter `key` locates as an output (`Rule.locate_output`); None when it is None."""
        where = self.param(key)
        return None if where is None else nodes[self.nodes[where[0]]].outputs[where[1]]

    def __str__(self) -> str:
        return f"{self.rule}@{self.root}"


@dataclass(frozen=True)
class NoMatch:
    """Why a rule does not apply at a node; falsy, so `if rule.check(...)` reads naturally."""

    rule: str
    node: str
    reason: str

    def __bool__(self) -> bool:
        return False


class RewriteError(RuntimeError):
    """A match could not be applied (stale, or from another graph)."""


class Rule:
    """Base class of every rewrite rule.  Subclasses set the class attributes and implement `check` and `rewrite`.

    Class attributes:
        name: unique kebab-case name.
        root_ops: operator types a match can be rooted at (the index `find` uses).
        contrib: True when the rewrite emits onnxruntime contrib operators (com.microsoft domain).
        cuda: False when the rewrite emits an operator onnxruntime's CUDA provider has no kernel for (FusedGemm): on
            CUDA that node would run on the CPU, between copies, and a captured CUDA graph refuses it outright; and
            for a rewrite whose only reason is a quirk of onnxruntime's CPU optimizer (`residual-bias-reorder`),
            until it is measured on CUDA.
        domains: operator domains a root may come from ("" and "ai.onnx" are the default domain); rules that undo
            onnxruntime fusions root at com.microsoft operators.
    The class docstring's first line says what it does: "Replaces `A(B(x))` with `C(x)`."

    An instance's `group` (one of GROUP_NAMES) is given where the registry lists it (`registry.py`); a rule built
    elsewhere (as part of another rule, in a test) has none.
    """

    name: ClassVar[str] = ""
    root_ops: ClassVar[tuple[str, ...]] = ()
    contrib: ClassVar[bool] = False
    cuda: ClassVar[bool] = True
    domains: ClassVar[tuple[str, ...]] = ("", "ai.onnx")

    def __init__(self, group: str = "") -> None:
        cls = type(self)
        self.group = group
        problems = []
        if not _KEBAB.match(self.name or ""):
            problems.append(f"name {self.name!r} is not kebab-case")
        if group and group not in GROUP_NAMES:
            problems.append(f"group {group!r} is not one of {GROUP_NAMES}")
        if not self.root_ops or not all(isinstance(op, str) for op in self.root_ops):
            problems.append("root_ops must be a non-empty tuple of operator types")
        if not self.description.startswith("Replaces ") or not self.description.endswith("."):
            problems.append("the docstring's first line must read 'Replaces ... .'")
        if problems:
            raise TypeError(f"rule {cls.__name__}: " + "; ".join(problems))

    @property
    def description(self) -> str:
        """The docstring's first line."""
        doc = (type(self).__doc__ or "").strip()
        return doc.splitlines()[0].strip() if doc else ""

    # -- to implement ------------------------------------------------------------------------------------------
    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        """Pure: whether and how the rule applies with `node` as root."""
        raise NotImplementedError

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        """Edits `graph` (a clone owned by `apply`) in place; `nodes` maps node names to nodes."""
        raise NotImplementedError

    # -- provided ----------------------------------------------------------------------------------------------
    def find(self, graph: Graph, roots: "RootIndex | None" = None) -> list[Match]:
        """Every match in the graph, in node order; `roots`: the graph's nodes by operator, where the caller has
        them."""
        return [m for m in self._checks(graph, roots) if m]

    def reasons(self, graph: Graph) -> list[NoMatch]:
        """Why the rule does not apply at each candidate root that it rejects."""
        return [m for m in self._checks(graph) if not m]

    def _checks(self, graph: Graph, roots: "RootIndex | None" = None) -> Iterable[Match | NoMatch]:
        for node in (roots or RootIndex(graph)).nodes(self.root_ops):
            if (node.domain or "") in self.domains:
                yield self.check(graph, node)

    def no(self, node: gs.Node, reason: str) -> NoMatch:
        """A NoMatch at `node`."""
        return NoMatch(self.name, node.name, reason)

    def match(self, nodes: Sequence[gs.Node], **params) -> Match:
        """A Match over `nodes` (root first) with plain parameters."""
        return Match(self.name, tuple(n.name for n in nodes), tuple(sorted(params.items())))

    def matched(self, node: gs.Node, found: str | tuple[Sequence[gs.Node], dict]) -> Match | NoMatch:
        """`check`'s answer at `node` from a pattern that returns a reason, or the nodes (root first) and parameters."""
        return self.no(node, found) if isinstance(found, str) else self.match(found[0], **found[1])

    @staticmethod
    def locate(nodes: Sequence[gs.Node], tensor: gs.Tensor | None) -> tuple[int, int] | None:
        """Where `tensor` is first read among `nodes` (the match's, in order) as (node, input), for `Match.input`;
        None for None.  A position, not a name: it holds on the clone `apply` edits, and after earlier rewrites of
        `apply_all` replaced what feeds it, as long as the match itself holds."""
        if tensor is None:
            return None
        return next((i, j) for i, node in enumerate(nodes) for j, t in enumerate(node.inputs) if t is tensor)

    @staticmethod
    def locate_output(nodes: Sequence[gs.Node], tensor: gs.Tensor | None) -> tuple[int, int] | None:
        """Where `tensor` is written among `nodes` as (node, output), for `Match.output`; None for None."""
        if tensor is None:
            return None
        return next((i, j) for i, node in enumerate(nodes) for j, t in enumerate(node.outputs) if t is tensor)

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


class RootIndex:
    """A graph's nodes by operator type, in graph order: each rule visits its roots alone, where a scan of every node
    per rule cost 110 rules x 1,000 nodes a `find_matches`."""

    def __init__(self, graph: Graph):
        self.by_op: dict[str, list[tuple[int, gs.Node]]] = {}
        for position, node in enumerate(graph.gs.nodes):
            self.by_op.setdefault(node.op, []).append((position, node))

    def nodes(self, ops: Sequence[str]) -> list[gs.Node]:
        if len(ops) == 1:
            return [node for _, node in self.by_op.get(ops[0], ())]
        return [node for _, node in sorted((p for op in dict.fromkeys(ops) for p in self.by_op.get(op, ())),
                                           key=lambda p: p[0])]

    def ops(self) -> set[str]:
        return set(self.by_op)


def find_matches(graph: Graph, rules: Sequence[Rule]) -> list[Match]:
    """Every match of every rule, in rule order then node order.  Pure: the graph is not modified."""
    roots = RootIndex(graph)
    return [m for rule in rules for m in rule.find(graph, roots)]


def apply(graph: Graph, match: Match, rules: Sequence[Rule]) -> Graph:
    """Applies a match to a clone of `graph` and returns the clone; `graph` itself is untouched.

    The match is checked again on the clone, so a stale match (or one from another graph) raises RewriteError rather
    than corrupting the result.
    """
    rule = next((r for r in rules if r.name == match.rule), None)
    if rule is None:
        raise RewriteError(f"unknown rule {match.rule!r}")
    result = graph.clone()
    nodes = result.node_map()
    root = nodes.get(match.root)
    if root is None:
        raise RewriteError(f"{match}: node {match.root!r} is not in the graph")
    again = rule.check(result, root)
    if again != match:
        raise RewriteError(f"{match}: the match no longer holds ({getattr(again, 'reason', 'different match')})")
    rule.rewrite(result, match, nodes)
    result.finish_edit()
    return result


def apply_all(graph: Graph, matches: Sequence[Match], rules: Sequence[Rule]) -> tuple[Graph, list[Match]]:
    """Applies each of `matches` that still holds, in order, to one clone of `graph`; returns the clone and the matches
    applied.  `graph` itself is untouched.

    One clone, sort and shape pass for all of them, where `apply` per match pays each, and those cost more than the
    rewrites themselves (a rule applied to every layer of a transformer would pay them once a layer).  Between rewrites
    the dead nodes are removed, so a match is checked again on a graph that only lacks the order and the new tensors'
    shapes, and is applied only where that check finds it exactly as given; anything else is skipped, for the caller
    to find again.  Replaying the matches applied one at a time gives the same graph.
    """
    by_name = {r.name: r for r in rules}
    result = graph.clone()
    result.remove_dead_nodes()
    nodes = result.node_map()
    applied = []
    for match in matches:
        rule = by_name.get(match.rule)
        if rule is None:
            raise RewriteError(f"unknown rule {match.rule!r}")
        if any(name not in nodes for name in match.nodes):
            continue
        try:
            again = rule.check(result, nodes[match.root])
        except Exception:  # noqa: BLE001 - a check may need a shape not inferred yet: skip the match
            continue
        if again != match:
            continue
        rule.rewrite(result, match, nodes)
        applied.append(match)
        result.remove_dead_nodes()
        nodes = result.node_map()
    if applied:
        result.finish_edit()
    return result, applied


EVERYWHERE_LIMIT = 48
"""Rewrites at most in one `apply_everywhere` beyond the matches it was given (a rule that keeps creating matches of
itself stops there; a 30-layer decoder's 60 rotary embeddings are all fused)."""


def apply_everywhere(graph: Graph, rule: Rule, matches: Sequence[Match], rules: Sequence[Rule],
                     deadline: float | None = None) -> tuple[Graph, list[Match]]:
    """`graph` with `rule` applied at all its matches, `matches` first (then found again after each pass, which moves
    the other matches' nodes): every match found first, and at most EVERYWHERE_LIMIT more that the passes create; and
    the rewrites applied.  `graph` is untouched.

    A network repeats its layers, so one decision usually holds for all of them.  A rewrite that raises ends the
    passes there (one faulty rule must never stop a search): what was applied before it is kept.
    """
    import time

    if all(r.name != rule.name for r in rules):  # a rule outside the registry (a contract's): its own matches apply
        rules = [*rules, rule]
    applied: list[Match] = []
    matches = list(matches)
    limit = len(matches) + EVERYWHERE_LIMIT
    while matches and len(applied) < limit:
        try:
            graph, done = apply_all(graph, matches[: limit - len(applied)], rules)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.debug("skipping %s everywhere: %s", rule.name, exc)
            break
        applied += done
        if not done or (deadline is not None and time.monotonic() > deadline):
            break
        matches = rule.find(graph)
    return graph, applied


def registry_version(rules: Sequence[Rule]) -> str:
    """A short hash of the ordered rule names: checkpoints trained on one action space refuse another."""
    return hashlib.sha256("\n".join(r.name for r in rules).encode()).hexdigest()[:12]
