"""The learned agent as a search method: a trained policy proposes rewrite sequences, measurement picks the winner.

The agent (the world-model agent shipped as `rlflow/checkpoints/default.pt`, see `rlflow.agents.actor`, or a
masked-PPO `rlflow.agents.policy.CandidatePolicy` such as `rlflow/checkpoints/ppo.pt`) plays a few episodes of
`rlflow/Rewrite-v0` on the model, in the scope it was trained in (one match or one rule wherever it matches per step,
`rlflow.env.rewrite_env.SCOPES`): the first greedily, stopping where the policy stops (a world-model agent trained
with `greedy_by="model"` takes there the rule its M predicts to pay most, `rlflow.agents.worldmodel_agent.Planning`);
the rest sampled from the policy's choice among rewrites, never stopping early (trained on a cost-model reward, a
policy stops as soon as it is unsure, so its own stop would leave the measurements nothing to choose from). An episode
never returns to a graph it has visited (inverse rules would otherwise loop), and the rollouts end early once a few in
a row leave the graphs to measure unchanged (`AgentConfig.patience`). The graphs the episodes end on, then those the
cost model ranks best, only those estimated faster, then the other end graphs (the cost table can misprice a held-out
model's groups), are measured end to end against the input, as many as the time limit affords, and beside them the
graph with every fusion applied wherever it matches and its variant with one fusion undone everywhere, the two the
cost model prices lowest (`rlflow.search.fuse_everything`); the fastest that is measurably faster wins, else the input
is kept, and the stop reason says when the fastest was the fuse-everything graph. The input is timed first (`measurement_reserve`), so that
the rollouts stop in time for that measurement. When not even one candidate fits (a large model), the input is kept
too, without a rollout, and the reason says what time limit would measure them: handing an unmeasured graph to the
final measurement of `rlflow.optimize.pipeline` would cost that measurement anyway, outside the limit (BERT-base: 35 s
of verification and gate after a 5 s search).
The search is therefore as safe as any other: the policy only decides which few graphs are worth measuring.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from tqdm import tqdm

from rlflow.errors import InputError
from rlflow.graph.core import Graph
from rlflow.measure.profile_comparison import profile_count
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace
from rlflow.rewrites import RULES, Rule
from rlflow.search.candidates import Candidate, SearchResult, distinct, rule_names
from rlflow.search.frozen_heap import frozen_heap
from rlflow.search.fuse_everything import INVERSE_NAMES, fuse_everything
from rlflow.search.selection import (
    RESERVE_SLACK,
    affordable,
    cost_table_lines,
    coverage,
    measurement_reserve,
    measuring_until,
    select_estimated,
    select_measured,
)
from rlflow.torch_threads import torch_threads

if TYPE_CHECKING:
    import torch

DEFAULT_AGENT = Path(__file__).resolve().parent.parent / "checkpoints" / "default.pt"
"""The shipped agent (package data): the world-model agent of `make agent` (docs/agents.md), trained for the CPU."""

CUDA_AGENT = DEFAULT_AGENT.with_name("cuda.pt")
"""The shipped agent trained against the CUDA cost table (`make agent-cuda`), where one ships."""


def shipped_agent(provider: str) -> Path:
    """The shipped agent `rlflow optimize` plays on `provider` (an onnxruntime provider name): the CUDA one on CUDA where
    it is installed, else the CPU one (which the default method then declines for CUDA: `default_method`)."""
    return CUDA_AGENT if provider == "CUDAExecutionProvider" and CUDA_AGENT.is_file() else DEFAULT_AGENT


@dataclass
class AgentConfig:
    """Settings of the agent search.

    Attributes:
        agent: checkpoint path (None: the shipped agent).
        rollouts: episodes played (the first greedy, the others sampled without the terminate action).
        length: steps per episode at most (and at most as many as the agent's training episodes had; a step is one
            rewrite, or one rule wherever it matches for an agent trained with `scope="rule"`).
        temperature: softness of the sampled episodes (1: the policy's own distribution).
        time_limit: seconds for the whole search, final measurements included.
        top_k: graphs measured end to end at the end.
        rounds: interleaved rounds of those measurements.
        seed: sampling, inputs and round order.
        patience: rollouts in a row that leave the `top_k` graphs to measure unchanged end the rollouts early (0:
            play all `rollouts` or until the limit); the agent's point is to be quick, and a rollout that changes
            nothing only costs time.
        measure: False ends on the graph of every rollout's that the cost model prices lowest, measuring nothing
            (scoring for a provider this machine lacks: `rlflow bench-estimate`).
        fuse_everything: measure two fuse-everything graphs (`rlflow.search.fuse_everything`) among the `top_k`,
            in place of the rollouts' last two, built from every rule offered, those appended to the registry after
            the agent was trained too (the policy plays only the rules it knows); False measures only the rollouts'
            graphs (what training's evaluation scores: the policy).
    """

    agent: str | None = None
    rollouts: int = 12
    length: int = 25
    temperature: float = 1.0
    time_limit: float = 30.0
    top_k: int = 4
    rounds: int = 15
    seed: int = 0
    patience: int = 3
    measure: bool = True
    fuse_everything: bool = True


def load_agent(path: str | os.PathLike | None = None):
    """The agent at `path` (default: the shipped agent), in evaluation mode: a masked-PPO candidate policy
    (`rlflow train --algo ppo`) or a world-model agent (`rlflow train --algo worldmodel`, as a
    `rlflow.agents.actor.WorldModelActor`).

    An agent trained on an earlier rule registry that this one extends is taken too: it acts on the rules it knows
    (`known_rules`).

    Raises:
        RlflowError: the file is missing, is not an rlflow agent, or was trained on a rule registry this one does not
            extend.
    """
    from rlflow.agents.checkpoint import checkpoint_algo
    from rlflow.agents.policy import load_checkpoint

    path = Path(path) if path is not None else DEFAULT_AGENT
    if path == DEFAULT_AGENT and not path.is_file():
        raise InputError(f"the shipped agent {path} is missing from this installation; reinstall rlflow, pass "
                         "--agent PATH, or use --method greedy")
    if checkpoint_algo(path) == "worldmodel":
        from rlflow.agents.actor import load_actor

        return load_actor(path)[0]
    policy, _ = load_checkpoint(path, prefix=True)
    return policy.eval()


def known_rules(agent, rules: Sequence[Rule] = RULES) -> list[Rule]:
    """The rules of `rules` that `agent` (a loaded policy or actor) was trained on: those whose action id is below
    the size of its registry.  `RULES` is append-only, so an agent trained before a rule was added knows every rule
    but the new ones, and its environment must not offer those (their ids index nothing it learnt)."""
    trained = getattr(agent, "n_rules", None)
    if trained is None:
        trained = agent.policy.n_rules  # a CandidateActor
    ids = {r.name: i for i, r in enumerate(RULES)}
    return [r for r in rules if ids.get(r.name, trained) < trained]


def trained_provider(path: str | os.PathLike | None = None) -> str:
    """The provider (`cpu` or `cuda`) the agent at `path` (default: the shipped one) was trained for: from the
    provenance file beside it (`<name>.json`, written by `rlflow.train.ship`), else from the checkpoint's own
    training config (read as every checkpoint is, without running code: `rlflow.agents.checkpoint.read_checkpoint`); `cpu`
    for a checkpoint that predates the setting."""
    from rlflow.agents.checkpoint import read_checkpoint

    path = Path(path) if path is not None else DEFAULT_AGENT
    recorded = _provenance(path).get("provider")
    if recorded:
        return recorded
    if not path.is_file():
        raise InputError(f"{path}: no such agent checkpoint")
    payload = read_checkpoint(path)
    return (payload.get("config") or {}).get("provider", "cpu")


def agent_rules(path: str | os.PathLike | None = None) -> list[str]:
    """The names of the rules the agent at `path` (default: the shipped one) was trained on, read from its checkpoint
    without running code."""
    from rlflow.agents.checkpoint import read_checkpoint

    path = Path(path) if path is not None else DEFAULT_AGENT
    if not path.is_file():
        raise InputError(f"{path}: no such agent checkpoint")
    return list(read_checkpoint(path)["rules"])


def offered_rules(path: str | os.PathLike | None = None) -> list[str] | None:
    """The rules that matched somewhere in the agent's training (`rules_offered` in the provenance file beside it,
    written by `rlflow.train.ship`), or None where the file does not say."""
    return _provenance(Path(path) if path is not None else DEFAULT_AGENT).get("rules_offered")


def _provenance(path: Path) -> dict:
    """The provenance file beside a checkpoint (`<name>.json`, written by `rlflow.train.ship`); {} where there is none."""
    import json

    provenance = path.with_suffix(".json")
    return json.loads(provenance.read_text()) if provenance.is_file() else {}


class CandidateActor:
    """A masked-PPO candidate policy behind the actor interface of `WorldModelActor` (it keeps no memory)."""

    def __init__(self, policy):
        self.policy = policy
        self.config = dict(getattr(policy, "config", None) or {})  # the training run's settings (`load_checkpoint`)

    def reset(self) -> None:
        pass

    def logits(self, obs) -> torch.Tensor:
        import torch

        from rlflow.env.observation import obs_to_torch

        with torch.no_grad():
            return self.policy(obs_to_torch(obs))[0][0].clone()

    def greedy_logits(self, obs) -> torch.Tensor:
        return self.logits(obs)

    def observe(self, action: int, obs) -> None:
        pass


def as_actor(policy):
    """`policy` with reset / logits / observe: a WorldModelActor as it is, a candidate policy wrapped."""
    from rlflow.agents.actor import WorldModelActor

    return policy if isinstance(policy, WorldModelActor) else CandidateActor(policy)


def agent_search(graph: Graph, settings: SessionSettings, config: AgentConfig | None = None,
                 rules: Sequence[Rule] = RULES, cost_model=None, policy=None, progress: bool = False) -> SearchResult:
    """Policy rollouts, then end-to-end measurement of the best few graphs; see the module docstring."""
    import torch

    from rlflow.env.rewrite_env import RewriteEnv, observation_caps
    from rlflow.measure.costmodel.model import CostModel

    config = config or AgentConfig()
    start = time.monotonic()
    pace = Pace()  # the input probed first: the measurement's share is then known, and it need not probe again
    reserve = _measurement_share(graph, settings, config, pace) if config.measure else 0.0
    search_deadline = start + config.time_limit - reserve
    if time.monotonic() >= search_deadline:  # a large model: measuring one candidate takes all the limit or more
        return SearchResult(graph, [], 0, time.monotonic() - start,
                            f"no time for rollouts: measuring one candidate against the input takes about "
                            f"{reserve:.0f} s of the {config.time_limit:.0f} s limit; a time limit of about "
                            f"{2 * reserve:.0f} s would leave the rollouts their share")
    actor = as_actor(policy if policy is not None else load_agent(config.agent))
    offered, rules = rules, known_rules(actor, rules)  # the policy plays the rules it knows; the priors take all
    cost_model = cost_model if cost_model is not None else CostModel(settings)  # an empty one is falsy
    generator = torch.Generator().manual_seed(config.seed)
    visited: dict[str, tuple[float, Candidate | None]] = {}
    endings: list[str] = []
    stop, steps = "all rollouts done", 0
    loaded = time.monotonic()
    # the policy on one torch thread: its forward passes are too small to gain from more (see `torch_threads`); the
    # heap held before the rollouts out of the collector's rescans (`frozen_heap`)
    with measuring_until(cost_model, loaded + COST_TABLE_SHARE * max(search_deadline - loaded, 0.0)), torch_threads(1), \
            frozen_heap():
        trained = actor.config  # its scope, and its episodes' length: what the actor learned to play
        env = RewriteEnv(graph, rules=rules, cost_model=cost_model, settings=settings,
                         scope=trained.get("scope", "match"),
                         max_episode_steps=min(config.length, int(trained.get("max_episode_steps", config.length))),
                         **observation_caps(graph))
        original_cost, original = cost_model.graph_cost(graph), graph.fingerprint()
        # before the rollouts, so that their pricing and rewriting (1-2 s on MiniLM-L12) comes out of the rollouts'
        # time rather than the measurement's, which then screened 2 of 4 candidates
        fused = (fuse_everything(Candidate(graph, (), original), offered, cost_model, search_deadline)
                 if config.fuse_everything and config.measure else [])
        chosen, unchanged = [], 0  # the graphs the measurement would get, and for how many rollouts they have held
        with tqdm(total=config.rollouts, desc="agent", unit="rollout", disable=not progress, leave=False) as bar:
            for rollout in range(config.rollouts):
                if time.monotonic() > search_deadline:
                    stop = "time limit"
                    break
                ending, taken = _play(env, actor, greedy=rollout == 0, temperature=config.temperature,
                                      generator=generator, deadline=search_deadline, visited=visited)
                endings.append(ending)
                steps += taken
                _forget_graphs(visited, endings, config.top_k)
                bar.update(1)
                now = [c.fingerprint for c in _pool(visited, endings, original_cost, original, config.top_k)]
                unchanged = unchanged + 1 if now == chosen else 0
                chosen = now
                if config.patience and unchanged >= config.patience:
                    stop = (f"settled: {config.patience} rollouts in a row changed none of the graphs to measure "
                            f"({len(endings)} of {config.rollouts} played)")
                    break
    cost_model.save()
    table = coverage(cost_model)
    late = cost_table_lines(table)
    if stop == "time limit":
        late.append(f"agent: {len(endings)} of {config.rollouts} rollouts played ({steps} rewrites) before the "
                    f"limit{'; the last one cut short' if time.monotonic() > search_deadline and endings else ''}")
    if not config.measure:
        result = select_estimated(graph, [pair for pair in visited.values() if pair[1] is not None], original_cost,
                                  start=start, stop_reason=stop, estimated=len(visited))
        result.not_reached, result.cost_table = late, table
        return result
    pool = _pool(visited, endings, original_cost, original, config.top_k)
    if fused:  # after the policy's own greedy episode, before what the estimates ranked
        pool = distinct(pool[:1] + fused + pool[1:])[: max(config.top_k, 1)]
    if not pool:
        return SearchResult(graph, [], 0, time.monotonic() - start,
                            f"{stop}; no graph the agent reached is estimated faster, and every episode ended "
                            "where it began",
                            candidates_estimated=len(visited), not_reached=late, cost_table=table)
    deadline, profiles = start + config.time_limit, profile_count(graph)
    if not affordable(pace, len(pool), deadline, profiles):  # a large model: even one candidate would overrun
        one, needed = (profiles * pace.block_seconds(n + 1, exports=n) for n in (1, len(pool)))
        late.append(f"measurement: none of {len(pool)} candidates measured end to end before the limit")
        return SearchResult(graph, [], 0, time.monotonic() - start,
                            f"{stop}; no time left to measure a candidate (one takes about {one:.0f} s, "
                            f"{max(deadline - time.monotonic(), 0):.0f} s were left; a time limit of about "
                            f"{2 * needed:.0f} s would measure {len(pool)})",
                            candidates_estimated=len(visited), candidates_unmeasured=len(pool), not_reached=late,
                            cost_table=table)
    result = select_measured(graph, pool, settings, rounds=config.rounds, seed=config.seed,
                             deadline=deadline, start=start, stop_reason=stop,
                             estimated=len(visited), pace=pace)
    result.not_reached[:0] = late
    result.cost_table = table
    won = next((f for f in fused if result.graph is f.graph), None)
    if won is not None:
        undone = rule_names(m for m in won.applied if m.rule in INVERSE_NAMES)
        preferred = f" with {undone} as the cost model prefers it" if undone else ""
        result.stop_reason += f" (the fuse-everything graph{preferred}, not a rollout's)"
    return result


ROLLOUT_SHARE = 0.5
"""Share of the time limit, from the search's start, in which rollouts start; the rest measures their graphs (more
where the measurement needs more: `_measurement_share`)."""

COST_TABLE_SHARE = 0.5
"""Share of the rollout time left once the agent is loaded in which groups the cost table lacks are measured; past it
they are estimated from their size (`CostModel.measuring_until`), so that on a model never seen the rollouts still get
the rest: a cold table of BERT L6/H384 takes 6 s to fill (and loading the agent 2-3 s of a 10 s limit)."""


MEASURE_SHARE = 0.7
"""Share of the time limit the measurement may take where measuring the `top_k` candidates needs more than half."""


def _measurement_share(graph: Graph, settings: SessionSettings, config: AgentConfig, pace: Pace) -> float:
    """Seconds of the limit kept for measuring: half of it, more where a probe of the input says one candidate takes
    more (`measurement_reserve`), and up to MEASURE_SHARE of it where the `top_k` take more, as the pace predicts
    the screening (MiniLM-L12 at 10 s: five sessions and four exports did not fit in the 5 s left, and the candidate
    left unmeasured was the faster fuse-everything variant)."""
    one = measurement_reserve(graph, settings, config.time_limit, pace, config.seed)
    top = RESERVE_SLACK * profile_count(graph) * pace.block_seconds(config.top_k + 1, exports=config.top_k)
    return max((1 - ROLLOUT_SHARE) * config.time_limit, one, min(top, MEASURE_SHARE * config.time_limit))


def _play(env, actor, *, greedy: bool, temperature: float, generator, deadline: float,
          visited: dict[str, tuple[float, Candidate | None]]) -> tuple[str, int]:
    """One episode; every graph reached goes into `visited` (fingerprint -> (estimated cost, candidate)).

    Returns the fingerprint of the graph the episode ended on, and the rewrites it applied.
    """
    from rlflow.agents.unvisited import choose_unvisited

    obs, _ = env.reset(options={"model": 0})
    actor.reset()
    seen = {env.fingerprint}
    done, taken = False, 0
    while not done and time.monotonic() < deadline:
        logits = actor.greedy_logits(obs) if greedy else actor.logits(obs)
        action = choose_unvisited(env, logits, seen, greedy=greedy, may_terminate=greedy,
                                  temperature=temperature, generator=generator)
        actor.observe(action, obs)
        obs, _, terminated, truncated, info = env.step(action)
        taken += 1
        done = terminated or truncated
        if env.fingerprint not in seen:
            seen.add(env.fingerprint)
            if visited.get(env.fingerprint, (0.0, None))[1] is None:  # new, or its graph dropped (`_forget_graphs`)
                visited[env.fingerprint] = (info["cost"], Candidate(env.graph, tuple(env.applied), env.fingerprint))
    return env.fingerprint, taken


def _forget_graphs(visited: dict[str, tuple[float, Candidate | None]], endings: list[str], top_k: int) -> None:
    """Drops the graphs of visited states neither `_pool` nor `select_estimated` can choose (kept: the episodes' end
    graphs and the `top_k` estimated cheapest), keeping their costs.  A visited graph holds the weights its rewrites
    made, and on a 30-layer decoder (SmolLM2's step, in float16) every graph of every rollout held took the CUDA
    agent's search past 15 GB."""
    keep = set(endings) | set(sorted(visited, key=lambda fp: visited[fp][0])[:top_k])
    for fp, (cost, candidate) in visited.items():
        if candidate is not None and fp not in keep:
            visited[fp] = (cost, None)


def _pool(visited: dict[str, tuple[float, Candidate | None]], endings: list[str], original_cost: float,
          original: str, top_k: int) -> list[Candidate]:
    """What to measure: the episodes' end graphs estimated faster, then the best-estimated others, then, where fewer
    than `top_k` are estimated faster, the other end graphs (the policy's own choice against the cost model's: on a
    model the table knows badly, such as MiniLM's 384-wide layers where it prices skip-LayerNormalization fusion 12%
    slower and end-to-end measurement finds it 1% faster, the estimates alone would leave nothing to measure)."""
    faster = {fp: pair for fp, pair in visited.items() if fp != original and pair[0] < original_cost}
    chosen = list(dict.fromkeys(fp for fp in endings if fp in faster))
    by_cost = sorted(faster, key=lambda fp: faster[fp][0])
    chosen += [fp for fp in by_cost if fp not in chosen]
    chosen += [fp for fp in dict.fromkeys(endings) if fp != original and fp not in chosen and fp in visited]
    return [visited[fp][1] for fp in chosen[:top_k]]


__all__ = ["AgentConfig", "CandidateActor", "DEFAULT_AGENT", "agent_search", "as_actor", "known_rules", "load_agent"]
