"""The graphs a rewrite environment has seen and the transitions between them, cached by fingerprint: an episode
that returns to a graph, or takes a rewrite it took before, costs a lookup instead of matching every rule, building
the observation arrays and asking the cost model again.  `GraphStates` is a mixin of `rlflow.env.rewrite_env.RewriteEnv`
(it reads the environment's rules, caps, cost model and scope)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlflow.env.features import candidate_arrays, graph_arrays, order_candidates
from rlflow.graph.core import Graph
from rlflow.rewrites import Match, RewriteError, apply, apply_everywhere, find_matches


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


class GraphStates:
    """The state and transition caches of `RewriteEnv` (see the module docstring)."""

    def _lookup(self, graph: Graph, fingerprint: str | None = None) -> State:
        """The cached state of `graph`'s fingerprint, built on first sight (a cached graph stands in for its equals)."""
        fingerprint = fingerprint or graph.fingerprint()
        state = self._states.get(fingerprint)
        if state is not None:
            self._states.move_to_end(fingerprint)
            return state
        matches = find_matches(graph, self.rules)
        candidates = order_candidates(matches, self.rule_ids, self.max_candidates)
        node_costs = self.cost_model.node_costs(graph)
        arrays = graph_arrays(graph, node_costs, max_nodes=self.max_nodes, max_edges=self.max_edges)
        state = State(graph, fingerprint, candidates, len(matches), {
            "node_op": arrays.node_op, "node_features": arrays.node_features, "node_mask": arrays.node_mask,
            "edge_index": arrays.edge_index, "edge_features": arrays.edge_features, "edge_mask": arrays.edge_mask,
        }, arrays.index, float(sum(node_costs.values())), unknown_shapes(graph))
        self._set_candidate_arrays(state)
        self._states[fingerprint] = state
        while len(self._states) > self.cache_size:
            self._states.popitem(last=False)
        return state

    def _set_candidate_arrays(self, state: State) -> None:
        rules, touched, mask = candidate_arrays(state.candidates, state.index, self.rule_ids,
                                                max_candidates=self.max_candidates)
        state.arrays.update(cand_rule=rules, cand_nodes=touched, cand_mask=mask)

    def _drop_candidate(self, state: State, match: Match) -> None:
        state.candidates = [m for m in state.candidates if m != match]
        self._set_candidate_arrays(state)

    def _child(self, state: State, match: Match) -> tuple[State, tuple[Match, ...]] | str:
        """The state after the action on `match` and the rewrites it applied (`scope`), or why the rewrite is refused;
        transitions are cached."""
        known = self._transitions.get((state.fingerprint, match))
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
        return child, applied

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


def unknown_shapes(graph: Graph) -> int:
    """Tensors computed by the graph whose static shape is unknown."""
    return sum(1 for node in graph.gs.nodes for t in node.outputs if t.name and graph.shape(t) is None)
