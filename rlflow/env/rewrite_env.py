"""The Gymnasium environment `rlflow/Rewrite-v0`: rewrite a real ONNX graph one (rule, location) match at a time.

    >>> import gymnasium, rlflow
    >>> env = gymnasium.make("rlflow/Rewrite-v0", model="model.onnx")   # doctest: +SKIP
    >>> obs, info = env.reset(seed=0)                                    # doctest: +SKIP
    >>> obs, reward, terminated, truncated, info = env.step(info["action_mask"].nonzero()[0][0])  # doctest: +SKIP

No torch here: the environment is numpy and onnxruntime only, so search code and tests can use it cheaply.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rlflow.env.features import (
    EDGE_FEATURES,
    MAX_EDGES,
    MAX_NODES,
    MAX_TOUCHED,
    NODE_FEATURES,
    OP_TYPES,
    observation_caps,
)
from rlflow.env.graph_states import CACHE_BYTES, GraphStates, State, in_memory_arrays
from rlflow.errors import InputError
from rlflow.graph.core import Graph, load
from rlflow.rewrites import RULES, Match, Rule

GLOBAL_FEATURES = ("cost_ratio", "log_initial_cost_us", "step_fraction", "log_nodes", "log_candidates")
"""Columns of the observation's `graph` vector."""

MAX_CANDIDATES = 256
"""Default cap on the candidate list (the action space is this plus one terminate action)."""

REWARD_SOURCES = ("cost", "measure")

SCOPES = ("match", "rule")
"""What one action rewrites: the chosen match only, or its rule everywhere it matches (the chosen match first)."""

FEATURE_MAX = 1e9
"""Upper bound of the float features (all are non-negative and log-scaled or ratios, so far below this)."""


class RewriteEnv(GraphStates, gym.Env):
    """Rewrite an ONNX graph with the rule library to make it faster on the target execution provider.

    ## Description
    The state is a real graph (`rlflow.Graph`).  Each step applies one match of one rule of `rules` (a *candidate*)
    and the graph changes; the agent is rewarded by how much the runtime dropped.  Given several models, each reset
    takes the next one in turn (a reset with a seed starts again from the first and zeroes the counters), so one
    environment can train a policy over a list of models.  The environment is deterministic: the seed only restarts
    the model cycle.

    ## Action Space
    `Discrete(max_candidates + 1)`.  Action `i < max_candidates` applies the i-th candidate of the current list
    (`find_matches` order with the rules interleaved, capped at `max_candidates`, see `rlflow.env.features`); action
    `max_candidates` (the last) terminates the episode.  `info["action_mask"]` (int8, same length) marks the valid
    actions: the listed candidates and terminate.  A masked action is not an error: the graph stays as it is, the
    reward is `invalid_penalty` (-1 by default) and `info["invalid_action"]` is True.  A candidate whose rewrite
    fails (a faulty rule), or whose result has more tensors without a static shape than its input (the cost model
    and the measurements need static shapes; `require_static_shapes=False` allows it), is dropped from the list,
    with reward 0 and `info["failed"]` naming it and saying why.

    With `scope="rule"` an action applies its candidate's rule at that match first, then wherever else the rule
    matches (`rlflow.rewrites.apply_everywhere`): a transformer repeats its layers, the gain of one layer's fusion is
    1-3% of a small model's time, and the graph every fusion makes takes 40-100 single rewrites on a 12-layer encoder,
    about 7 rule-wide ones.

    ## Observation Space
    A `Dict` of fixed-shape arrays (N = max_nodes, E = max_edges, C = max_candidates, K = 4):
    `node_op` (N,) int64 operator ids (`rlflow.env.features.OP_TYPES`); `node_features` (N, 10) float32 (output size,
    rank, FLOPs, estimated cost and its share, input/output counts; see `NODE_FEATURES`); `node_mask` (N,) int8;
    `edge_index` (E, 2) int64 producer -> consumer node rows; `edge_features` (E, 6) float32 (tensor size, rank,
    first four dimensions); `edge_mask` (E,) int8; `cand_rule` (C,) int64 rule ids (indices into
    `rlflow.rewrites.RULES`, whatever subset `rules` searches); `cand_nodes` (C, K) int64 rows of the nodes each
    candidate touches, root first, -1 for none or dropped;
    `cand_mask` (C,) int8; `graph` (5,) float32 (cost / initial cost, log initial cost, step fraction, log node and
    candidate counts).  Nodes past N and edges past E are dropped (see `rlflow.env.features`).

    ## Rewards
    `100 * (previous - new) / initial` where the runtime comes from the reward source: `"cost"` (default) the cost
    model's estimate after every step; `"measure"` an end-to-end onnxruntime measurement every `measure_every` steps
    and when the episode ends (0 in between; graphs already measured are not measured again, the cache is keyed by
    fingerprint); or any callable `Graph -> ms` evaluated after every step.  The return of an episode is therefore the
    percentage of the initial runtime it saved.

    ## Starting State
    The (next) model as loaded, unmodified.

    ## Episode End
    Terminated: the terminate action, or no candidate is left.  Truncated: `max_episode_steps` steps (invalid and
    failed actions count).

    ## Info
    `action_mask`; `real_steps`, `measurements` and `cost_evaluations` (counters since construction or the last
    reset with a seed, for sample-efficiency comparisons; a measurement is an end-to-end timing, cache misses only);
    `episode_steps`; `cost`, `initial_cost` and `speedup` (initial / current): the cost model's estimates whatever
    the reward source; `runtime` and `initial_runtime`: the reward source's latest
    and first values (ms); `applied` (the rewrites so far), `n_matches` (before the cap), `model`.

    ## Arguments
    `model` (path, Graph, or a sequence of them), `rules` (default `RULES`), `reward` (`"cost"`, `"measure"` or a
    callable), `cost_model` (default `CostModel(settings)`; it also gives the per-node cost features), `settings`
    (onnxruntime session settings), `scope` (`"match"` or `"rule"`), `measure_every`, `max_episode_steps`,
    `max_nodes`, `max_edges`, `max_candidates`, `invalid_penalty`, `require_static_shapes`, `input_shapes`,
    `cache_size` and `cache_bytes` (graphs kept by fingerprint, least recently used evicted past either; see
    `rlflow.env.graph_states.CACHE_BYTES`), `render_mode` (`"ansi"`).

    ## Version History
    * v0: first version (rule registry as given by `rlflow.rewrites.REGISTRY_VERSION`).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, model: str | os.PathLike | Graph | Sequence[str | os.PathLike | Graph] | None = None, *,
                 rules: Sequence[Rule] = RULES, reward: str | Callable[[Graph], float] = "cost", cost_model=None,
                 settings=None, scope: str = "match", measure_every: int = 5, measure_repeats: int = 30,
                 max_episode_steps: int = 50,
                 max_nodes: int = MAX_NODES, max_edges: int = MAX_EDGES, max_candidates: int = MAX_CANDIDATES,
                 invalid_penalty: float = -1.0, require_static_shapes: bool = True, input_shapes: dict | None = None,
                 cache_size: int = 4096, cache_bytes: int = CACHE_BYTES, render_mode: str | None = None):
        if model is None:
            raise InputError("RewriteEnv needs a model: gymnasium.make('rlflow/Rewrite-v0', model=PATH)")
        if not isinstance(reward, str) and not callable(reward):
            raise ValueError(f"reward must be one of {REWARD_SOURCES} or a callable Graph -> ms")
        if isinstance(reward, str) and reward not in REWARD_SOURCES:
            raise ValueError(f"reward must be one of {REWARD_SOURCES} or a callable Graph -> ms, not {reward!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        if max_episode_steps < 1 or measure_every < 1 or max_candidates < 1:
            raise ValueError("max_episode_steps, measure_every and max_candidates must be >= 1")
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        if not self.models:
            raise InputError("RewriteEnv needs at least one model")
        self.rules = tuple(rules)
        # rule ids are registry indices whatever subset is searched: the action-id space of DESIGN.md
        self.rule_ids = {r.name: i for i, r in enumerate(RULES)}
        for rule in self.rules:
            self.rule_ids.setdefault(rule.name, len(self.rule_ids))
        self.require_static_shapes = require_static_shapes
        self.scope = scope
        self.reward_source = reward
        from rlflow.measure.session import SessionSettings

        self.settings = settings or SessionSettings()
        self._cost_model = cost_model
        self.measure_every = measure_every
        self.measure_repeats = measure_repeats
        self.max_episode_steps = max_episode_steps
        self.max_nodes, self.max_edges, self.max_candidates = max_nodes, max_edges, max_candidates
        self.invalid_penalty = float(invalid_penalty)
        self.input_shapes = input_shapes
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.render_mode = render_mode

        n, e, c = max_nodes, max_edges, max_candidates
        self.observation_space = spaces.Dict({
            "node_op": spaces.Box(0, len(OP_TYPES) - 1, (n,), np.int64),
            "node_features": spaces.Box(0.0, FEATURE_MAX, (n, len(NODE_FEATURES)), np.float32),
            "node_mask": spaces.Box(0, 1, (n,), np.int8),
            "edge_index": spaces.Box(0, n - 1, (e, 2), np.int64),
            "edge_features": spaces.Box(0.0, FEATURE_MAX, (e, len(EDGE_FEATURES)), np.float32),
            "edge_mask": spaces.Box(0, 1, (e,), np.int8),
            "cand_rule": spaces.Box(0, max(len(self.rule_ids) - 1, 0), (c,), np.int64),
            "cand_nodes": spaces.Box(-1, n - 1, (c, MAX_TOUCHED), np.int64),
            "cand_mask": spaces.Box(0, 1, (c,), np.int8),
            "graph": spaces.Box(0.0, FEATURE_MAX, (len(GLOBAL_FEATURES),), np.float32),
        })
        self.action_space = spaces.Discrete(c + 1)
        self.terminate_action = c

        # counters over the environment's life (sample efficiency)
        self.real_steps = 0
        self.measurements = 0
        self.cost_evaluations = 0

        self._graphs: dict[int, Graph] = {}
        self._init_caches()
        self._measured: dict[str, float] = {}
        self._next_model = 0
        self._state: State | None = None
        self._start: State | None = None
        self.model_index = 0
        self.episode_steps = 0
        self.applied: list[Match] = []
        self.initial_runtime = 1.0
        self._last_reward_cost = 1.0

    # ------------------------------------------------------------------------------------------------ public state
    @property
    def graph(self) -> Graph:
        """The current graph."""
        if self._state is None:
            raise RuntimeError("call reset() first")
        return self._state.graph

    @property
    def candidates(self) -> list[Match]:
        """The current candidate list: action i applies candidates[i]."""
        return list(self._state.candidates) if self._state is not None else []

    @property
    def cost_model(self):
        """The cost model (created on first use): node cost features, and rewards when `reward="cost"`."""
        if self._cost_model is None:
            from rlflow.measure.costmodel.model import CostModel

            self._cost_model = CostModel(self.settings)
        return self._cost_model

    def model_name(self, index: int | None = None) -> str:
        """A short name for model `index` (default: the current one)."""
        model = self.models[self.model_index if index is None else index]
        if isinstance(model, Graph):
            return os.path.basename(model.source or "") or f"graph{index if index is not None else self.model_index}"
        return os.path.splitext(os.path.basename(os.fspath(model)))[0]

    def action_mask(self) -> np.ndarray:
        """int8 (max_candidates + 1,): 1 for each listed candidate and for terminate."""
        mask = np.zeros(self.max_candidates + 1, np.int8)
        if self._state is not None:
            mask[: len(self._state.candidates)] = 1
        mask[self.terminate_action] = 1
        return mask

    def peek(self, action: int) -> str | None:
        """The fingerprint of the graph that `action` leads to, without taking the step.

        Lets a caller refuse a rewrite that returns to a graph it has already visited (inverse rules, such as
        matmul-add-to-gemm and gemm-to-matmul-add, undo each other).  The rewrite is applied and cached, so the step
        that may follow costs nothing more.  None for terminate, an invalid action or a rewrite that is refused.
        """
        if self._state is None or not 0 <= int(action) < len(self._state.candidates):
            return None
        child = self._child(self._state, self._state.candidates[int(action)])
        return None if isinstance(child, str) else child[0].fingerprint

    @property
    def fingerprint(self) -> str:
        """The current graph's fingerprint."""
        if self._state is None:
            raise RuntimeError("call reset() first")
        return self._state.fingerprint

    # --------------------------------------------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if seed is not None:  # a seeded reset starts afresh: model cycle and counters (caches are kept)
            self._next_model = 0
            self.real_steps = self.measurements = self.cost_evaluations = 0
        if "model" in options:
            index = int(options["model"])
            if not 0 <= index < len(self.models):
                raise ValueError(f"options['model'] must be in [0, {len(self.models)})")
        else:
            index = self._next_model % len(self.models)
            self._next_model = index + 1
        self.model_index = index
        graph = self._load(index)
        self._state = self._start = self._lookup(graph)
        self.episode_steps = 0
        self.applied = []
        self.initial_runtime = self._reward_cost(self._state, force=True)
        self._last_reward_cost = self.initial_runtime
        return self._observation(), self._info()

    def step(self, action):
        if self._state is None:
            raise RuntimeError("call reset() first")
        action = int(action)
        self.real_steps += 1
        self.episode_steps += 1
        extra: dict[str, Any] = {}
        reward = 0.0
        terminated = False
        n_candidates = len(self._state.candidates)
        if action == self.terminate_action:
            terminated = True
        elif not 0 <= action < n_candidates:
            reward = self.invalid_penalty
            extra["invalid_action"] = True
        else:
            match = self._state.candidates[action]
            child = self._child(self._state, match)
            if isinstance(child, str):
                self._drop_candidate(self._state, match)
                extra["failed"] = f"{match}: {child}"
            else:
                self._state, applied = child
                self.applied += applied
            terminated = not self._state.candidates
        truncated = not terminated and self.episode_steps >= self.max_episode_steps
        done = terminated or truncated
        new_cost = self._reward_cost(self._state, force=done)
        if new_cost is not None:
            reward += 100.0 * (self._last_reward_cost - new_cost) / self.initial_runtime
            self._last_reward_cost = new_cost
        obs = self._observation()
        info = self._info()
        info.update(extra)
        return obs, float(reward), terminated, truncated, info

    def render(self):
        if self.render_mode != "ansi" or self._state is None:
            return None
        cost = self._current_cost()
        applied = ", ".join(str(m) for m in self.applied[-5:])
        return (f"{self.model_name()}: step {self.episode_steps}/{self.max_episode_steps}, {len(self._state.graph)} "
                f"nodes, {len(self._state.candidates)} candidates, estimated {cost:.4f} ms "
                f"({self._initial_estimate() / max(cost, 1e-12):.3f}x){'; last: ' + applied if applied else ''}")

    # ----------------------------------------------------------------------------------------------- internals
    def _load(self, index: int) -> Graph:
        graph = self._graphs.get(index)
        if graph is None:
            model = self.models[index]
            if isinstance(model, Graph):
                graph = model
            else:
                graph = load(model, self.input_shapes)
            self._graphs[index] = graph
            self._model_weights.update(in_memory_arrays(graph))
        return graph

    def _current_cost(self) -> float:
        """The cost model's estimate of the current graph (the `cost` info entry whatever the reward source)."""
        return float(self._state.cost)

    def _reward_cost(self, state: State, force: bool) -> float | None:
        """The reward source's runtime of `state` (ms), or None when this step is not measured."""
        source = self.reward_source
        if source == "cost":
            self.cost_evaluations += 1
            return float(state.cost)
        if callable(source):
            self.cost_evaluations += 1
            return float(source(state.graph))
        if not force and self.episode_steps % self.measure_every:
            return None
        measured = self._measured.get(state.fingerprint)
        if measured is None:
            from rlflow.measure.timing import time_model

            timing = time_model(state.graph.to_model(static=True), self.settings, repeats=self.measure_repeats)
            measured = self._measured[state.fingerprint] = timing.median_ms
            self.measurements += 1
        return measured

    def _observation(self) -> dict[str, np.ndarray]:
        state = self._state
        obs = {key: value.copy() for key, value in state.arrays.items()}
        obs["graph"] = np.clip(np.array([
            self._current_cost() / max(self._initial_estimate(), 1e-12),
            np.log1p(1000.0 * self._initial_estimate()),
            self.episode_steps / self.max_episode_steps,
            np.log1p(len(state.graph)),
            np.log1p(state.n_matches),
        ], np.float32), 0.0, FEATURE_MAX)
        return obs

    def _initial_estimate(self) -> float:
        """The cost model's estimate of the episode's starting graph (for the observation, whatever the reward)."""
        return float(self._start.cost) if self._start is not None else 1.0

    def _info(self) -> dict[str, Any]:
        cost = self._current_cost()
        start = self._initial_estimate()
        return {
            "action_mask": self.action_mask(),
            "real_steps": self.real_steps,
            "measurements": self.measurements,
            "cost_evaluations": self.cost_evaluations,
            "episode_steps": self.episode_steps,
            "cost": cost,
            "initial_cost": start,
            "speedup": start / max(cost, 1e-12),
            "applied": [str(m) for m in self.applied],
            "runtime": self._last_reward_cost,
            "initial_runtime": self.initial_runtime,
            "n_matches": self._state.n_matches,
            "model": self.model_name(),
        }


__all__ = ["RewriteEnv", "GLOBAL_FEATURES", "MAX_CANDIDATES", "MAX_NODES", "MAX_EDGES", "REWARD_SOURCES", "SCOPES",
           "observation_caps"]
