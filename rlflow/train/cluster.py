"""`rlflow train --ray [ADDRESS]`: the real environment's steps played on a Ray cluster's nodes; the networks still
train where the driver runs.

The world-model loop (`RayEpisodes`) plays each real episode as one task; masked PPO (`RayRollouts`) splits each
update's rollout into one segment per node, each node's environment running its episodes on from one update to the
next (a segment's last step bootstraps from where its own environment went, so segments never leak into each
other's advantages).  Every task holds its node's measurement slot, so a node plays one thing at a time, and runs
only on nodes of the driver's machine kind: rewards are measured runtimes, and another kind's would be another
environment (where the rewards are estimated, as for CUDA on machines without it, every node qualifies).  A task gets
the models as bytes through the object store (unpacked once per worker process), the acting policy's weights (put
once per iteration or update) and a seed, and sends back what it played and what it added to its node's cost
tables, which the driver merges (`rlflow.cluster.travel`).  The world model's states are told apart by digest
(`Replay.digest`), so the count-based exploration on a node sees the driver's counts.  A task whose worker or node
dies costs what it was playing (an episode, a segment): a node that is gone leaves the pool, and the next task goes
to another.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
import typing
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

from rlflow.cluster.connection import MEASUREMENT_SLOT, connected, measuring_nodes, node_label
from rlflow.cluster.travel import TableMerger, gains, install_tables, pack_model, ship_tables
from rlflow.errors import RlflowError

log = logging.getLogger("rlflow")

ENV_FIELDS = ("reward", "measure_every", "max_episode_steps", "max_nodes", "max_edges", "max_candidates", "scope")
"""What a node needs of the driver's environment settings to build the same environment."""


@dataclasses.dataclass
class Setup:
    """What every task of a run needs once per worker process: the models, the environment's settings, the provider
    and the driver's cost tables."""

    models: list
    env: dict
    provider: str
    threads: int
    tables: dict


_WORKER: dict = {}
"""In a worker process: run key -> (environment, its folder, measurements installed), (run key, "stream") -> PPO's
stream on it, and the last agent or policy it acted with."""


def _kind(estimated: bool) -> tuple:
    """A node's machine kind for rewards: machine and onnxruntime (anything, where rewards are estimated)."""
    import onnxruntime as ort

    from rlflow.measure.costmodel.table import machine_id

    return () if estimated else (machine_id(), ort.__version__)


def _environment(key: str, box: list):
    """This worker's environment for run `key`, built on first use: the models unpacked into a folder of its own,
    the driver's tables installed before the cost model reads them."""
    import ray
    import torch

    from rlflow.measure.costmodel.gpu_estimate import cost_model_for
    from rlflow.train.common import make_env

    if key not in _WORKER:
        setup: Setup = ray.get(box[0])
        torch.set_num_threads(setup.threads)
        folder = tempfile.TemporaryDirectory(prefix="rlflow-episodes-")
        paths = [parcel.unpack(Path(folder.name) / str(i)) for i, parcel in enumerate(setup.models)]
        installed = install_tables(ray, setup.tables)
        env = make_env(paths, dataclasses.make_dataclass("EnvConfig", ENV_FIELDS)(**setup.env),
                       cost_model_for(setup.provider))
        _WORKER.clear()  # one run's environment at a time
        _WORKER[key] = (env, folder, installed)
        return env, installed
    return _WORKER[key][0], 0


def _agent(box: list | None):
    """The acting agent whose weights `box` holds (cached per worker until the next iteration's)."""
    import ray

    from rlflow.agents.worldmodel_agent import Agent

    if box is None:
        return None
    ref = box[0]
    if _WORKER.get("agent_ref") != ref.hex():
        weights = ray.get(ref)
        agent = Agent(weights["spec"], weights["n_rules"], optimisers=False)
        for part, state in weights["parts"].items():
            getattr(agent, part).load_state_dict(state)
            getattr(agent, part).eval()
        _WORKER["agent_ref"], _WORKER["agent"] = ref.hex(), agent
    return _WORKER["agent"]


class _ByDigest:
    """The (state, rule) counts of count-based exploration, kept by state digest so that a node's replay of its own
    reads the driver's counts (what `real_episode` needs of its `tried` dict: `get` and item assignment)."""

    def __init__(self, replay, counts: dict):
        self.replay, self.counts = replay, counts

    def get(self, key, default=0):
        return self.counts.get((self.replay.digest(key[0]), key[1]), default)

    def __setitem__(self, key, value) -> None:
        self.counts[(self.replay.digest(key[0]), key[1])] = value


def play(key: str, setup_box: list, agent_box: list | None, job: dict) -> dict:
    """The task: one real episode on this node (`job`: the model's index, a seed, `real_episode`'s keywords and the
    driver's exploration counts by digest); returns it with its states and the node's cost-table gain."""
    import torch

    from rlflow.train.worldmodel.episodes import real_episode
    from rlflow.train.worldmodel.replay import Replay

    start = time.monotonic()
    env, installed = _environment(key, setup_box)
    agent = _agent(agent_box)
    torch.manual_seed(job["seed"])
    replay = Replay(job["n_rules"])
    tried = _ByDigest(replay, job["tried"]) if job["tried"] is not None else None
    with gains() as home:
        episode = real_episode(env, job["model"], agent, replay, np.random.default_rng(job["seed"]), tried=tried,
                               **job["episode"])
    home["installed"] = installed
    return {"episode": dataclasses.asdict(episode), "states": replay.states, "masks": replay.rule_masks,
            "node": node_label(), "home": home, "seconds": time.monotonic() - start}


def _weights(agent) -> dict | None:
    """What a node needs to act as `agent`: its spec, rule count and the acting parts' weights."""
    if agent is None:
        return None
    parts = {name: getattr(agent, name).state_dict() for name in ("vision", "mdrnn", "policy", "location")
             if getattr(agent, name) is not None}
    return {"spec": agent.spec, "n_rules": agent.n_rules, "parts": parts}


class _OnCluster:
    """What both trainers' players share: the connection, the pool of nodes of the driver's kind, the setup every
    worker fetches once, tasks run one per node at a time, lost nodes, the cost tables and the per-node report."""

    def __init__(self, address: str, paths: list[Path], env_config, provider: str, threads: int, estimated: bool,
                 cost_cache: str | None = None):
        self._stack = contextlib.ExitStack()
        self.ray = ray = self._stack.enter_context(connected(address))
        try:
            self.pool, self.skipped = self._pool(estimated)
            setup = Setup([pack_model(p) for p in paths], {f: getattr(env_config, f) for f in ENV_FIELDS}, provider,
                          threads, ship_tables(ray, cost_cache))
        except BaseException:
            self._stack.close()
            raise
        self.key = uuid.uuid4().hex
        self.setup_box = [ray.put(setup)]  # in a list: a worker fetches it once, not with every task
        self.n_models = len(paths)
        self.merger = TableMerger(cost_cache)
        self.nodes: dict[str, dict] = {}
        self.lost = 0
        self.address = address

    def _pool(self, estimated: bool) -> tuple[list[str], list[str]]:
        """The measuring nodes of the driver's kind, and those skipped."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self.ray
        nodes = measuring_nodes(ray)
        probe = ray.remote(num_cpus=0)(_kind)
        kinds = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            estimated) for n in nodes])
        here = _kind(estimated)
        pool = [n for n, kind in zip(nodes, kinds) if kind == here]
        if not pool:
            raise RlflowError(f"no node of the Ray cluster is of this machine's kind ({', '.join(map(str, here))}): "
                              f"its rewards would be another machine's; {len(nodes)} nodes offer a measurement slot")
        return pool, [n for n in nodes if n not in pool]

    def _run(self, task, jobs: Iterator[dict], weights_box: list | None, done: typing.Callable[[dict], int],
             steps: int | None = None, nodes: typing.Sequence[str] | None = None) -> None:
        """Runs `task` on `jobs`, one per pool node at a time (`nodes`: the first job on the first of them, and so
        on, one job each), until the jobs run out or `done` (called with each result, returning its real steps) has
        counted `steps`."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self.ray
        remote = ray.remote(num_cpus=0, resources={MEASUREMENT_SLOT: 1}, max_retries=0)(task)
        free, pending, taken = list(nodes if nodes is not None else self.pool), {}, 0
        while True:
            while free and (steps is None or taken < steps):
                job = next(jobs, None)
                if job is None:
                    break
                node = free.pop(0)
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                pending[remote.options(scheduling_strategy=strategy).remote(self.key, self.setup_box, weights_box,
                                                                            job)] = node
            if not pending:
                return
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            node = pending.pop(ref)
            try:
                played = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self._lose(node, exc)
                if node in self.pool and nodes is None:
                    free.append(node)
                continue
            if nodes is None:
                free.append(node)
            self.merger.merge(played["node"], played["home"])
            stats = self.nodes.setdefault(played["node"], {"tasks": 0, "steps": 0, "seconds": 0.0})
            real = done(played)
            stats["tasks"] += 1
            stats["steps"] += real
            stats["seconds"] += played["seconds"]
            taken += real

    def _lose(self, node: str, exc: Exception) -> None:
        self.lost += 1
        alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        log.warning("a task was lost on node %s (%s)%s", node[:8], type(exc).__name__,
                    "" if node in alive else ": the node is gone")
        if node not in alive:
            self.pool.remove(node)
            if not self.pool:
                raise RlflowError("every node of the machine's kind left the Ray cluster: nothing can be played")

    def report(self) -> dict:
        """What the trainer's report records of the cluster: per node its tasks (episodes or rollout segments),
        steps and seconds; tasks lost; nodes skipped; the cost tables' travel."""
        return {"address": self.address, "nodes": self.nodes, "lost_tasks": self.lost,
                "skipped_nodes": len(self.skipped), "cost_tables": self.merger.summary()}

    def close(self) -> None:
        """Leaves the cluster, saying what each node played."""
        per_node = ", ".join(f"{node} {n['steps']} steps in {n['tasks']} tasks" for node, n in sorted(self.nodes.items()))
        tables = self.merger.summary()
        print(f"on the Ray cluster: {per_node or 'nothing played'}; {self.lost} tasks lost; {tables['added']} "
              f"measurements came home to {tables['cache']}", flush=True)
        self._stack.close()


class RayEpisodes(_OnCluster):
    """The world-model trainer's real episodes on a Ray cluster (`collect` and `evaluate` as
    `rlflow.train.worldmodel.episodes` plays them here)."""

    def collect(self, agent, replay, steps: int, config, rng: np.random.Generator, *, iteration: int,
                progress=None) -> list:
        """As `rlflow.train.worldmodel.episodes.collect`: episodes, models in turn, until `steps` real steps (the
        episodes still running then are kept)."""
        from rlflow.train.worldmodel.episodes import tried_pairs

        counts = ({(replay.digest(s), a): n for (s, a), n in tried_pairs(replay.episodes).items()}
                  if config.explore_untried else None)
        first = len(replay.episodes)

        def jobs():
            for i in range(first, first + 10**9):
                yield {"model": i % self.n_models, "episode": dict(
                    greedy=False, epsilon=config.explore_epsilon, random_terminate=config.random_terminate,
                    heldout=bool(rng.random() < config.heldout_fraction),
                    source="random" if agent is None else "controller", iteration=iteration,
                    random_locations=config.learn_location, explore_by_match=config.explore_by_match)}

        return self._play(jobs(), agent, replay, rng, counts, steps, progress)

    def evaluate(self, agent, replay, config, rng: np.random.Generator, iteration: int,
                 reward_range: tuple | None = None) -> list:
        """As `rlflow.train.worldmodel.episodes.evaluate_real`: one greedy episode per model."""
        from rlflow.agents.worldmodel_agent import Planning

        planning = Planning.of(dataclasses.asdict(config), reward_range)
        jobs = ({"model": index, "episode": dict(greedy=True, heldout=bool(rng.random() < config.heldout_fraction),
                                                 source="eval", iteration=iteration,
                                                 avoid_revisits=config.avoid_revisits, planning=planning)}
                for index in range(self.n_models))
        episodes = self._play(jobs, agent, replay, rng, None, None, None)
        return sorted(episodes, key=lambda e: e.model)

    def _play(self, jobs: Iterator[dict], agent, replay, rng, counts: dict | None, steps: int | None,
              progress) -> list:
        """Plays `jobs` until they run out or `steps` real steps are in; the episodes join `replay` as they come."""
        episodes = []

        def stamped(jobs):
            for job in jobs:
                yield {**job, "seed": int(rng.integers(2**31)), "n_rules": replay.n_rules, "tried": counts}

        def done(played: dict) -> int:
            episode = self._merge(played, replay, counts)
            episodes.append(episode)
            if progress is not None:
                progress.update(len(episode.actions))
            return len(episode.actions)

        box = [self.ray.put(_weights(agent))] if agent is not None else None
        self._run(play, stamped(jobs), box, done, steps)
        return episodes

    @staticmethod
    def _merge(played: dict, replay, counts: dict | None):
        """The node's episode in the driver's replay: its states added (once) and renumbered."""
        from rlflow.train.worldmodel.replay import Episode

        ids = [replay.add_state(state, mask) for state, mask in zip(played["states"], played["masks"])]
        episode = Episode(**{**played["episode"], "states": [ids[s] for s in played["episode"]["states"]]})
        replay.episodes.append(episode)
        if counts is not None:
            for s, a in zip(episode.states, episode.actions):
                key = (replay.digest(s), a)
                counts[key] = counts.get(key, 0) + 1
        return episode


# ----------------------------------------------------------------------------------------------------- masked PPO
def _policy(box: list):
    """The PPO policy whose weights `box` holds (cached per worker until the next update's)."""
    import ray

    from rlflow.agents.policy import CandidatePolicy

    ref = box[0]
    if _WORKER.get("policy_ref") != ref.hex():
        weights = ray.get(ref)
        policy = CandidatePolicy(*weights["shape"])
        policy.load_state_dict(weights["state"])
        _WORKER["policy_ref"], _WORKER["policy"] = ref.hex(), policy
    return _WORKER["policy"]


def play_segment(key: str, setup_box: list, policy_box: list, job: dict) -> dict:
    """The task: one segment of an update's rollout on this node, its environment's episodes running on from the
    worker's last segment (a new worker starts its environment afresh)."""
    import torch

    from rlflow.train.rollout import Stream, play

    start = time.monotonic()
    env, installed = _environment(key, setup_box)
    policy = _policy(policy_box)
    stream = _WORKER.get((key, "stream"))
    if stream is None:
        stream = _WORKER[(key, "stream")] = Stream(env).start(job["seed"])
    torch.manual_seed(job["seed"])
    with gains() as home:
        rollout = play(policy, stream, job["steps"], job["gamma"])
    home["installed"] = installed
    return {"rollout": rollout, "node": node_label(), "home": home, "seconds": time.monotonic() - start}


class RayRollouts(_OnCluster):
    """Masked PPO's rollouts on a Ray cluster: each update's steps split into one segment per node
    (`rlflow.train.ppo.Learner.collect`'s `source`)."""

    def __init__(self, address: str, paths: list[Path], config, estimated: bool):
        super().__init__(address, paths, config, config.provider, config.threads, estimated)
        self.gamma = config.gamma

    def rollouts(self, policy, steps: int, rng: np.random.Generator) -> list:
        """`steps` real steps as segments, one per node (a lost node's segment is missing from the list)."""
        nodes = list(self.pool)
        sizes = [steps // len(nodes) + (i < steps % len(nodes)) for i in range(len(nodes))]
        jobs = iter([{"steps": size, "gamma": self.gamma, "seed": int(rng.integers(2**31))} for size in sizes])
        box = [self.ray.put({"shape": (policy.n_rules, policy.hidden, policy.n_rounds),
                             "state": policy.state_dict()})]
        segments = []

        def done(played: dict) -> int:
            rollout = played["rollout"]
            rollout.next_obs = {k: np.array(v) for k, v in rollout.next_obs.items()}  # writable, as torch wants
            segments.append(rollout)
            return len(rollout.actions)

        self._run(play_segment, jobs, box, done, nodes=nodes)
        if not segments:
            raise RlflowError("every rollout segment of this update was lost on the Ray cluster")
        return segments


__all__ = ["RayEpisodes", "RayRollouts", "play", "play_segment"]
