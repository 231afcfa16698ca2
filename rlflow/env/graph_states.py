"""The graphs a rewrite environment has seen and the transitions between them, cached by fingerprint: an episode
that returns to a graph, or takes a rewrite it took before, costs a lookup instead of matching every rule, building
the observation arrays and asking the cost model again.  `GraphStates` is a mixin of `rlflow.env.rewrite_env.RewriteEnv`
(it reads the environment's rules, caps, cost model and scope)."""
from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.env.features import candidate_arrays, graph_arrays, order_candidates
from rlflow.graph.core import Graph
from rlflow.rewrites import Match, RewriteError, apply, apply_everywhere, find_matches

CACHE_BYTES = 512 << 20
"""Default memory budget of the state cache (see `state_bytes`).  A count cap alone is not a bound: a state of a
deployment export holds 3-10 MB (its graph, and the weights its rewrites concatenated, split or scaled), and masked
PPO on eight such exports (`make ppo-agent-cuda`) passed 10 GB resident within 1,024 steps (#49); with this budget
it stayed at 3.2-3.4 GB over the same steps."""

NODE_BYTES = 3200
"""Memory of one graph node in a cached state's graph, with its tensors (graphsurgeon objects; about 3.2 KB per
node on the DistilBERT and DeiT exports)."""


@dataclass
class State:
    """One graph the environment has seen, with everything derived from it (cached by fingerprint)."""

    graph: Graph
    fingerprint: str
    candidates: list[Match]
    n_matches: int
    arrays: dict[str, np.ndarray]
    index: dict[str, int]
    cost: float
    unknown_shapes: int
    weights: dict[int, int] = field(default_factory=dict)  # id -> bytes of the in-memory arrays its rewrites made
    nbytes: int = 0  # its own memory, besides `weights` (which states may share)


class GraphStates:
    """The state and transition caches of `RewriteEnv` (see the module docstring)."""

    def _init_caches(self) -> None:
        self._states: OrderedDict[str, State] = OrderedDict()
        self._cached_bytes = 0  # the state cache's memory (`state_bytes`)
        self._cached_weights: dict[int, list[int]] = {}  # array id -> [cached states holding it, bytes]
        self._model_weights: set[int] = set()  # ids of the loaded models' in-memory arrays (held anyway)
        # (fingerprint, match) -> (child fingerprint, rewrites applied); in scope "rule" also (fingerprint, rule name)
        self._transitions: dict[tuple[str, Match | str], tuple[str, tuple[Match, ...]]] = {}
        # fingerprint -> candidates whose rewrite failed there, so that a state built again lacks them too (one entry
        # per state a rewrite failed on: small, kept)
        self._dropped: dict[str, set[Match]] = {}

    def _lookup(self, graph: Graph, fingerprint: str | None = None) -> State:
        """The cached state of `graph`'s fingerprint, built on first sight (a cached graph stands in for its equals)."""
        fingerprint = fingerprint or graph.fingerprint()
        state = self._states.get(fingerprint)
        if state is not None:
            self._states.move_to_end(fingerprint)
            return state
        matches = find_matches(graph, self.rules)
        candidates = order_candidates(matches, self.rule_ids, self.max_candidates)
        if fingerprint in self._dropped:
            candidates = [m for m in candidates if m not in self._dropped[fingerprint]]
        node_costs = self.cost_model.node_costs(graph)
        arrays = graph_arrays(graph, node_costs, max_nodes=self.max_nodes, max_edges=self.max_edges)
        state = State(graph, fingerprint, candidates, len(matches), {
            "node_op": arrays.node_op, "node_features": arrays.node_features, "node_mask": arrays.node_mask,
            "edge_index": arrays.edge_index, "edge_features": arrays.edge_features, "edge_mask": arrays.edge_mask,
        }, arrays.index, float(sum(node_costs.values())), unknown_shapes(graph))
        self._set_candidate_arrays(state)
        self._cache(state)
        return state

    def _cache(self, state: State) -> None:
        """Keeps `state`, evicting the least recently used states beyond `cache_size` states or `cache_bytes` bytes
        (`state_bytes`; arrays that several states share count once, the models' own weights not at all)."""
        state.nbytes, state.weights = state_bytes(state, self._model_weights)
        self._states[state.fingerprint] = state
        self._cached_bytes += state.nbytes
        for key, size in state.weights.items():
            held = self._cached_weights.get(key)
            if held is None:
                self._cached_weights[key] = [1, size]
                self._cached_bytes += size
            else:
                held[0] += 1
        while len(self._states) > self.cache_size or (self._cached_bytes > self.cache_bytes and len(self._states) > 1):
            _, old = self._states.popitem(last=False)
            self._cached_bytes -= old.nbytes
            for key in old.weights:
                held = self._cached_weights[key]
                held[0] -= 1
                if not held[0]:
                    del self._cached_weights[key]
                    self._cached_bytes -= held[1]

    def _set_candidate_arrays(self, state: State) -> None:
        rules, touched, mask = candidate_arrays(state.candidates, state.index, self.rule_ids,
                                                max_candidates=self.max_candidates)
        state.arrays.update(cand_rule=rules, cand_nodes=touched, cand_mask=mask)

    def _drop_candidate(self, state: State, match: Match) -> None:
        state.candidates = [m for m in state.candidates if m != match]
        self._set_candidate_arrays(state)
        self._dropped.setdefault(state.fingerprint, set()).add(match)

    def _child(self, state: State, match: Match) -> tuple[State, tuple[Match, ...]] | str:
        """The state after the action on `match` and the rewrites it applied (`scope`), or why the rewrite is refused;
        transitions are cached."""
        known = self._transitions.get((state.fingerprint, match)) or self._rule_wide(state, match)
        if known is not None and known[0] in self._states:
            self._states.move_to_end(known[0])
            return self._states[known[0]], known[1]
        try:
            graph, applied = self._rewrite(state.graph, match)
        except Exception as exc:  # noqa: BLE001 - a faulty rule must not end training; the candidate is dropped
            return f"rewrite failed ({type(exc).__name__}: {exc})"
        if self.require_static_shapes:
            unknown = unknown_shapes(graph)
            if unknown > state.unknown_shapes:
                return f"the result has {unknown - state.unknown_shapes} more tensors without a static shape"
        child = self._lookup(graph)
        if len(self._transitions) >= 16 * self.cache_size:  # bounded like the state cache (crudely: it only saves time)
            self._transitions.clear()
        self._transitions[(state.fingerprint, match)] = (child.fingerprint, applied)
        if self.scope == "rule":
            self._transitions[(state.fingerprint, match.rule)] = (child.fingerprint, applied)
        return child, applied

    def _rule_wide(self, state: State, match: Match) -> tuple[str, tuple[Match, ...]] | None:
        """Where the action applies its rule wherever it matches (scope "rule"): the transition another location of
        the same rule took from `state`, when it applied `match` too (so the same rewrites, `match` listed first).
        A rollout refusing a rule that leads back peeked at each of its locations, a rule-wide rewrite apiece: 15 of
        a held-out ELECTRA's 80 peeks rebuilt a graph already built."""
        known = self._transitions.get((state.fingerprint, match.rule)) if self.scope == "rule" else None
        if known is None or match not in known[1]:
            return None
        return known[0], (match, *(m for m in known[1] if m != match))

    def _rewrite(self, graph: Graph, match: Match) -> tuple[Graph, tuple[Match, ...]]:
        """`graph` after the action on `match`: the match alone, or (scope "rule") its rule wherever it matches.

        Raises:
            RewriteError (or whatever a faulty rule raises): the chosen match does not apply.
        """
        if self.scope == "match":
            return apply(graph, match, self.rules), (match,)
        rule = next(r for r in self.rules if r.name == match.rule)
        others = [m for m in rule.find(graph) if m != match]
        result, applied = apply_everywhere(graph, rule, [match, *others], self.rules)
        if not applied or applied[0] != match:
            raise RewriteError(f"{match}: the match no longer holds")
        return result, tuple(applied)


def in_memory_arrays(graph: Graph) -> dict[int, np.ndarray]:
    """id -> the arrays that hold the graph's constants in memory (a view's base, never a map of a file)."""
    found = {}
    for tensor in graph.gs.tensors().values():
        values = tensor._values if isinstance(tensor, gs.Constant) else None
        while isinstance(values, np.ndarray) and isinstance(values.base, np.ndarray):
            values = values.base
        mapped = isinstance(values, np.memmap) or isinstance(getattr(values, "base", None), mmap.mmap)
        if isinstance(values, np.ndarray) and not mapped:
            found[id(values)] = values
    return found


def state_bytes(state: State, model_weights: set[int]) -> tuple[int, dict[int, int]]:
    """The approximate memory of a cached state: its own (observation arrays, `NODE_BYTES` per node), and
    id -> bytes of the in-memory weight arrays its graph holds beyond `model_weights` (the loaded models' own)."""
    own = sum(a.nbytes for a in state.arrays.values()) + NODE_BYTES * len(state.graph.gs.nodes)
    return own, {key: a.nbytes for key, a in in_memory_arrays(state.graph).items() if key not in model_weights}


def unknown_shapes(graph: Graph) -> int:
    """Tensors computed by the graph whose static shape is unknown."""
    return sum(1 for node in graph.gs.nodes for t in node.outputs if t.name and graph.shape(t) is None)
