"""Rules written as patterns: a rule states the subgraph it replaces as an expression, and the engine here finds it.

    x = var("x")
    pattern = product(const(0.5), x, op.Add(const(1.0), op.Erf(op.Div(x, const(SQRT2)) | op.Mul(x, const(1 / SQRT2)))))

* `op.T(a, b, ...)`: a node of operator T (default domain unless `domain=` says) whose inputs match a, b, ...;
  Add, Mul, Max, Min and Sum also match with their two inputs swapped.  `attrs=` requires attribute values.
* `var("x")`: any tensor, bound on first sight; a name seen again must be the same tensor.
* `p.bind("d")`: p, its tensor named d; `var("d")` elsewhere is that tensor, which several of the pattern's nodes may
  read (a centred input both squared and divided).  `ANY`: any tensor, unbound.
* `const(v)`: a constant whose elements all equal v (to a relative 1e-3); `constant("w")`: any constant, bound.
* `product(a, b, c)` / `total(...)`: a tree of Muls / Adds, in any association and order, whose operands match
  a, b, c (exporters write `0.5 * x * y` as `(x * y) * 0.5` or `x * (0.5 * y)`).
* `a | b`: either form, tried in order (the variants each exporter writes).
* `a.otherwise("reason")`: a failure inside `a` is refused with that reason.

Every inner node must be private (read by the pattern alone, no graph output): the rewrite removes it (`inner_reads`:
checked once matched).  A `PatternRule` gives a `pattern`, a `condition` on what was bound and a `replacement`; the
engine makes the `Rule` contract of `base.py` from them: `check` is pure and returns a `Match` (the nodes, root first,
each variable located among them) or a `NoMatch` naming the deepest place the pattern failed, and `apply` re-checks
before it rewrites.  Learnt from onnxscript's rewriter (pattern, check, replacement) and torch inductor's pattern
matcher; it works on rlflow's graph directly, so matching costs no conversion (docs/design.md, "Conventions").
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, NamedTuple

import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, RootIndex, Rule
from rlflow.rewrites.edits import replace_typed
from rlflow.rewrites.queries import operand_tree, private, scalar

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum"})


class Found(NamedTuple):
    """One way the pattern matched: its nodes (root first) and the tensors its variables and constants bound (a
    NamedTuple: the engine makes thousands of them per graph)."""

    nodes: tuple[gs.Node, ...]
    bound: tuple[tuple[str, gs.Tensor], ...] = ()
    shared: tuple[gs.Tensor, ...] = ()  # inner tensors the pattern reads more than once (`Pattern.bind`)

    def __getitem__(self, name: str) -> gs.Tensor:
        return dict(self.bound)[name]

    def get(self, name: str) -> gs.Tensor | None:
        return dict(self.bound).get(name)

    def bind(self, name: str, tensor: gs.Tensor) -> "Found | None":
        """This state with `name` bound to `tensor`; None where it is bound to another tensor."""
        seen = dict(self.bound).get(name)
        if seen is not None:
            return self if seen is tensor else None
        return Found(self.nodes, self.bound + ((name, tensor),), self.shared)

    def closed(self, outputs: set[int]) -> bool:
        """Whether every shared tensor is read by the pattern's nodes alone, and is none of the graph's `outputs`."""
        inside = {id(n) for n in self.nodes}
        return all(id(t) not in outputs and all(id(n) in inside for n in t.outputs) for t in self.shared)


class _Search:
    """One match attempt at one root: the graph, and the deepest failure met, for the NoMatch's reason."""

    def __init__(self, graph: Graph, relaxed: bool = False):
        self.graph, self.relaxed = graph, relaxed  # relaxed: inner nodes may be shared; checked once matched
        self.outputs = {id(t) for t in graph.gs.outputs}
        self.failure: tuple = (-1, "")  # (nodes matched, reason format, its arguments): formatted once, if reported

    def fail(self, state: Found, reason: str, *args) -> Iterator[Found]:
        if len(state.nodes) > self.failure[0]:
            self.failure = (len(state.nodes), reason, *args)
        return iter(())

    def reason(self) -> str:
        return self.failure[1].format(*self.failure[2:])


class Pattern:
    """Matches a tensor: `states` yields every way it does, extending `state`."""

    def states(self, search: _Search, tensor: gs.Tensor, state: Found, root: bool = False) -> Iterator[Found]:
        raise NotImplementedError

    def root_ops(self) -> tuple[str, ...]:
        return ()

    def needs(self) -> frozenset[str]:
        """Operator types every match of this pattern contains (a graph lacking one has no match)."""
        return frozenset()

    def __or__(self, other: "Pattern") -> "Pattern":
        return Either((self, other))

    def bind(self, name: str) -> "Pattern":
        """This pattern, its tensor bound to `name`: a variable of that name elsewhere is the same tensor, and the
        tensor may be read by several of the pattern's nodes (none outside it)."""
        return Bound(self, name)

    def otherwise(self, reason: str) -> "Pattern":
        """This pattern, whose failures read `reason` (a refusal in the rule's own words)."""
        return Labelled(self, reason)


@dataclass(frozen=True)
class Anything(Pattern):
    def states(self, search, tensor, state, root=False):
        return iter((state,))


ANY = Anything()
"""Any tensor, not bound (an input the rule does not look at, such as ReduceMean's axes at opset 18)."""


@dataclass(frozen=True)
class Var(Pattern):
    name: str

    def states(self, search, tensor, state, root=False):
        bound = state.bind(self.name, tensor)
        return iter((bound,)) if bound is not None else search.fail(state, "{} is not the {} read before", tensor.name,
                                                                      self.name)


@dataclass(frozen=True)
class Const(Pattern):
    value: float
    name: str | None = None  # bound too, where the replacement needs the constant itself

    def states(self, search, tensor, state, root=False):
        found = scalar(Graph.constant(tensor))
        if found is None or not math.isclose(found, self.value, rel_tol=1e-3):
            return search.fail(state, "{} is not the constant {:g}", tensor.name, self.value)
        bound = state.bind(self.name, tensor) if self.name else state
        return iter(()) if bound is None else iter((bound,))


@dataclass(frozen=True)
class AnyConst(Pattern):
    name: str

    def states(self, search, tensor, state, root=False):
        if Graph.constant(tensor) is None:
            return search.fail(state, "{} is not a constant", tensor.name)
        bound = state.bind(self.name, tensor)
        return iter(()) if bound is None else iter((bound,))


@dataclass(frozen=True)
class Either(Pattern):
    options: tuple[Pattern, ...]

    def states(self, search, tensor, state, root=False):
        for option in self.options:
            yield from option.states(search, tensor, state, root)

    def root_ops(self):
        return tuple(dict.fromkeys(op for option in self.options for op in option.root_ops()))

    def needs(self):
        return frozenset.intersection(*(option.needs() for option in self.options))

    def __or__(self, other):
        return Either((*self.options, other))


@dataclass(frozen=True)
class Labelled(Pattern):
    inner: Pattern
    reason: str

    def states(self, search, tensor, state, root=False):
        before, matched = search.failure, False
        for found in self.inner.states(search, tensor, state, root):
            matched = True
            yield found
        if not matched and search.failure is not before:
            search.failure = (search.failure[0], self.reason)

    def root_ops(self):
        return self.inner.root_ops()

    def needs(self):
        return self.inner.needs()


@dataclass(frozen=True)
class Bound(Pattern):
    inner: Pattern
    name: str

    def states(self, search, tensor, state, root=False):
        seen = state.get(self.name)
        if seen is not None and seen is not tensor:
            return search.fail(state, "{} is not {}", tensor.name, self.name)
        if seen is not None and _among(Graph.producer(tensor), state.nodes):
            return iter((state,))  # matched already, where the pattern met it first
        if not root:
            state = Found(state.nodes, state.bound, state.shared + (tensor,))
        inner = self.inner.states(search, tensor, state, root=True)
        return (bound for found in inner if (bound := found.bind(self.name, tensor)))

    def root_ops(self):
        return self.inner.root_ops()

    def needs(self):
        return self.inner.needs()


def _producer(search: _Search, tensor: gs.Tensor, state: Found, root: bool, op: str, domain: str) -> gs.Node | None:
    """The node of `op` writing `tensor`, where the pattern may take it: not taken yet, and private unless the root
    (or bound: `Bound` checks its readers once the match is complete)."""
    node = Graph.producer(tensor)
    if node is None or node.op != op or (node.domain or "") not in ((domain,) if domain else ("", "ai.onnx")):
        return None
    if _among(node, state.nodes) or (not root and not search.relaxed and not private(search.graph, tensor)):
        return None
    return node


def _among(item, items) -> bool:
    """`item` is one of `items` (by identity: gs compares nodes and tensors by name and more)."""
    for other in items:
        if other is item:
            return True
    return False


@dataclass(frozen=True)
class Op(Pattern):
    op: str
    inputs: tuple[Pattern, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    domain: str = ""

    def states(self, search, tensor, state, root=False):
        node = _producer(search, tensor, state, root, self.op, self.domain)
        if node is None:
            return search.fail(state, "{} is not a private {}", tensor.name, self.op)
        if len(node.inputs) != len(self.inputs) or any(node.attrs.get(k) != v for k, v in self.attrs):
            return search.fail(state, "{}: not {} with {} inputs and {}", node.name, self.op, len(self.inputs),
                               dict(self.attrs))
        state = Found((*state.nodes, node), state.bound, state.shared)
        if self.op in COMMUTATIVE and len(node.inputs) == 2:
            return itertools.chain(_all(search, self.inputs, node.inputs, state),
                                   _all(search, self.inputs, node.inputs[::-1], state))
        return _all(search, self.inputs, node.inputs, state)

    def root_ops(self):
        return (self.op,)

    def needs(self):
        return frozenset({self.op}).union(*(p.needs() for p in self.inputs))


@dataclass(frozen=True)
class Tree(Pattern):
    """A tree of private `op` nodes (Mul, Add) whose operands match `operands` in some order."""

    op: str
    operands: tuple[Pattern, ...]

    def states(self, search, tensor, state, root=False):
        node = _producer(search, tensor, state, root, self.op, "")
        if node is None:
            return search.fail(state, "{} is not a private {}", tensor.name, self.op)
        leaves, nodes = operand_tree(search.graph, node, depth=len(self.operands) - 1)
        if len(leaves) != len(self.operands) or any(_among(n, state.nodes) for n in nodes):
            return search.fail(state, "{}: not a {} of {} operands", node.name, self.op, len(self.operands))
        return _assigned(search, self.operands, leaves, Found((*state.nodes, *nodes), state.bound, state.shared))

    def root_ops(self):
        return (self.op,)

    def needs(self):
        return frozenset({self.op}).union(*(p.needs() for p in self.operands))


def _all(search: _Search, patterns: tuple[Pattern, ...], tensors, state: Found) -> Iterator[Found]:
    """Every state in which each of `patterns` matches the tensor beside it, found lazily (the first is often all the
    rule needs)."""
    if not patterns:
        yield state
        return
    for found in patterns[0].states(search, tensors[0], state):
        yield from _all(search, patterns[1:], tensors[1:], found)


def _assigned(search: _Search, patterns: tuple[Pattern, ...], leaves: list, state: Found) -> Iterator[Found]:
    """Every state in which `patterns` match `leaves` in some order: each pattern in turn tries each leaf left (one
    tensor appearing twice, x in x * x, is tried once)."""
    if not patterns:
        yield state
        return
    for k, leaf in enumerate(leaves):
        if k and _among(leaf, leaves[:k]):
            continue
        for found in patterns[0].states(search, leaf, state):
            yield from _assigned(search, patterns[1:], leaves[:k] + leaves[k + 1:], found)


class _Ops:
    """`op.Mul(a, b)` is `Op("Mul", (a, b))`."""

    def __getattr__(self, name: str) -> Callable[..., Op]:
        def build(*inputs: Pattern, domain: str = "", **attrs) -> Op:
            return Op(name, tuple(inputs), tuple(sorted(attrs.items())), domain)
        return build


op = _Ops()


def var(name: str) -> Var:
    return Var(name)


def const(value: float, name: str | None = None) -> Const:
    return Const(float(value), name)


def constant(name: str) -> AnyConst:
    return AnyConst(name)


def product(*operands: Pattern) -> Tree:
    return Tree("Mul", tuple(operands))


def total(*operands: Pattern) -> Tree:
    return Tree("Add", tuple(operands))


class PatternRule(Rule):
    """A rule whose match is `pattern` (rooted at the node checked), refused where `condition` gives a reason; its
    rewrite points the root's readers at what `replacement` builds.  `root_ops` comes from the pattern."""

    pattern: ClassVar[Pattern]
    needed_ops: ClassVar[frozenset[str]] = frozenset()  # from the pattern: operators every match contains
    inner_reads: ClassVar[str | None] = None
    """Where set, inner nodes may be read elsewhere while matching, and a match whose inner values are read outside it
    is refused with this reason (a rule's own words, where a failure deep in the pattern would say less)."""
    variables: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "pattern" in cls.__dict__:
            cls.root_ops = cls.__dict__.get("root_ops") or cls.pattern.root_ops()
            cls.needed_ops = cls.pattern.needs()

    def condition(self, graph: Graph, found: Found) -> str | None:
        """Why a structural match may not be rewritten (None: it may)."""
        return None

    def params(self, graph: Graph, found: Found) -> dict:
        """Plain values the rewrite needs beyond the variables' tensors (an axis, an epsilon)."""
        return {}

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        """The tensor that replaces the root's output, built from the bound tensors (`variables`)."""
        raise NotImplementedError

    def find(self, graph: Graph, roots: RootIndex | None = None) -> list[Match]:
        """As `Rule.find`, skipping the graph at once where it lacks an operator every match contains (`reasons` still
        gives each root's own)."""
        roots = roots or RootIndex(graph)
        if not self.needed_ops <= roots.ops():
            return []
        return super().find(graph, roots)

    def found(self, graph: Graph, node: gs.Node) -> Found | str:
        """The first way the pattern matches at `node` that `condition` accepts, or why none does."""
        search = _Search(graph, relaxed=self.inner_reads is not None)
        refused = None
        for found in self.pattern.states(search, node.outputs[0], Found(()), root=True):
            inner = Found(found.nodes, found.bound, found.shared + tuple(o for n in found.nodes[1:] for o in n.outputs))
            if not (inner if search.relaxed else found).closed(search.outputs):
                refused = refused or self.inner_reads or "an intermediate tensor is read outside the pattern"
                continue
            refused = self.condition(graph, found)
            if refused is None:
                return found
        return refused or (search.reason() if search.failure[0] >= 0 else "no match")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self.found(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        located = {name: self.locate(found.nodes, found.get(name)) for name in self.variables}
        return self.match(found.nodes, **located, **self.params(graph, found))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        tensors = {name: match.input(name, nodes) for name in self.variables}
        replace_typed(graph, nodes[match.root].outputs[0], self.replacement(graph, tensors, match))
