"""Model-free baseline: masked PPO on the real rewrite environment (CleanRL's ppo.py, adapted).

One environment holds every training model and hands them out in turn, one episode each.  The policy is the
candidate-scoring graph network of `rlflow.agents.policy`; invalid actions are masked out of the distribution.
Everything the world-model agent is compared on is counted: real environment steps, end-to-end measurements and
cost-model evaluations.

At the end the trained policy is evaluated (`rlflow.train.evaluate`) on each model, and on held-out models it
never trained on, against `rlflow.search.random_walk` with the same measurement budget.  Results go to
`<out>/ppo.json` and the learning curve (mean episode return vs real steps) to `<out>/ppo-learning-curve.png`; metrics
(`charts/`, `losses/`, `eval/`) and checkpoints go to `<run_dir>`.

    rlflow train --algo ppo --models squeezenet-1.1-tiny,resnet-18-tiny --total-steps 4000 --out docs/results
"""
from __future__ import annotations

import dataclasses
import logging
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from rlflow.env.rewrite_env import MAX_EDGES, MAX_NODES
from rlflow.train.common import CsvWriter, make_env, resolve_models, seed_everything, write_ppo_results

log = logging.getLogger("rlflow")

DEFAULT_MODELS = ("squeezenet-1.1-tiny", "resnet-18-tiny", "resnet-50-tiny", "resnext-50-32x4d-tiny",
                  "inception-v3-tiny", "mobilenet-v2-tiny", "densenet-121-tiny", "nasrnn-tiny", "bert-base-tiny",
                  "vit-b-16-tiny", "gpt2-small-tiny")
"""The -tiny zoo models the acceptance run trains on (nasnet-a-mobile-tiny is left out: the cost model cannot
measure some of its groups and counts them as 0, which a learner would exploit)."""


@dataclass
class Config:
    """Settings of a PPO run (CleanRL's names where CleanRL has one).

    Attributes:
        models: zoo model names (built into `zoo_dir` when needed) or paths of .onnx files; trained in turn.
        holdout: models evaluated at the end but never trained on (generalisation check).
        total_steps: real environment steps of training.
        num_steps: steps per rollout (one PPO update each).
        learning_rate: Adam learning rate (X-RLflow: 5e-4).
        anneal_lr: decay the learning rate linearly to 0.
        gamma: discount (X-RLflow: 0.99).
        gae_lambda: GAE lambda (X-RLflow: 0.95).
        num_minibatches: minibatches per epoch.
        update_epochs: epochs over each rollout.
        norm_adv: normalise advantages per minibatch.
        clip_coef: PPO clip (X-RLflow: 0.2).
        clip_vloss: clip the value loss too.
        ent_coef: entropy bonus.
        vf_coef: value loss weight.
        max_grad_norm: gradient clipping.
        target_kl: stop an update's epochs early beyond this approximate KL (None: never).
        hidden: width of the graph network and heads.
        rounds: message-passing rounds.
        max_episode_steps: episode step limit (truncation).
        max_nodes: observation node cap (the deployment section's exports fit in the default).
        max_edges: observation edge cap.
        max_candidates: candidate cap (actions = this + terminate).
        scope: what an action rewrites: "match" (the chosen match) or "rule" (its rule everywhere it matches); the
            agent search plays the scope its checkpoint was trained in.
        reward: "cost" (cost model, every step) or "measure" (end-to-end every `measure_every` steps and at the end).
        measure_every: steps between measurements with reward="measure".
        seed: seeds torch, numpy, random and the environment.
        threads: torch threads (1: polite on shared machines).
        provider: the execution provider the agent is trained for.  `cuda` on a machine without CUDA trains against
            the shipped H100 cost table and its fitted estimate (`rlflow.measure.costmodel.gpu_estimate`); nothing can be measured
            there, so the end-to-end evaluation is skipped and reward="measure" is refused.
        ray: play each update's rollout on the Ray cluster at this address (`--ray` alone: one started here), split
            into one segment per node of this machine's kind (`rlflow.train.cluster`); None: here.
        out: folder of ppo.json and the learning-curve PNG.
        run_dir: folder of metrics CSVs and checkpoints.
        zoo_dir: where zoo models are built (default: the zoo cache).
        checkpoint_every: updates between checkpoints (and one at the end).
        time_limit: seconds of training at most (None: until total_steps).
        evaluate: run the final evaluation.
        eval_walks: random-walk restarts of the baseline.
        eval_rounds: interleaved rounds of the final end-to-end comparison.
        eval_time_limit: seconds per model for the random-walk baseline.
        baseline_episodes: uniformly random episodes per model at the start (the curve's reference line).
    """

    models: tuple[str, ...] = DEFAULT_MODELS
    holdout: tuple[str, ...] = ("demo-block",)
    total_steps: int = 12_000
    num_steps: int = 256
    learning_rate: float = 5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 8
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    hidden: int = 64
    rounds: int = 3
    max_episode_steps: int = 25
    max_nodes: int = MAX_NODES
    max_edges: int = MAX_EDGES
    max_candidates: int = 256
    scope: typing.Literal["match", "rule"] = "match"
    reward: str = "cost"
    measure_every: int = 5
    seed: int = 0
    threads: int = 1
    provider: typing.Literal["cpu", "cuda"] = "cpu"
    ray: str | None = field(default=None, metadata={"const": "local"})
    out: str = "docs/results"
    run_dir: str = "build/ppo"
    zoo_dir: str | None = None
    checkpoint_every: int = 10
    time_limit: float | None = None
    evaluate: bool = True
    eval_walks: int = 20
    eval_rounds: int = 30
    eval_time_limit: float = 30.0
    baseline_episodes: int = 3


def random_episodes(env, episodes: int, rng: np.random.Generator) -> list[float]:
    """Returns of uniformly random valid actions (terminate included), `episodes` per model of `env`."""
    returns = []
    for _ in range(episodes):
        for index in range(len(env.models)):
            _, info = env.reset(options={"model": index})
            total, done = 0.0, False
            while not done:
                action = int(rng.choice(np.flatnonzero(info["action_mask"])))
                _, reward, terminated, truncated, info = env.step(action)
                total += reward
                done = terminated or truncated
            returns.append(total)
    return returns


class Learner:
    """Masked PPO's rollout buffers, collection and update (CleanRL's loop body), for training and fine-tuning alike.

    `collect()` plays `config.num_steps` real steps with the current policy (episodes continue across calls), here or,
    given `source` (`rlflow.train.cluster.RayRollouts`), as segments played on a cluster's nodes; `update()` computes
    GAE advantages over each segment and runs the clipped-objective epochs over all of them.
    """

    def __init__(self, policy, env, config: Config, rng: np.random.Generator, writer: CsvWriter | None = None):
        from torch import optim

        self.policy, self.env, self.config, self.rng, self.writer = policy, env, config, rng, writer
        self.optimizer = optim.Adam(policy.parameters(), lr=config.learning_rate, eps=1e-5)
        self.episodes: list[dict] = []
        self.stream = None  # the environment's stream here, started by the first rollout played here
        self.segments: list = []  # the last rollout's, `rlflow.train.rollout.Rollout`s
        self.counters = {"real_steps": 0, "measurements": 0, "cost_evaluations": 0}

    def collect(self, source=None) -> None:
        """One rollout of `num_steps` real steps; finished episodes are appended to `episodes`, stamped with the run's
        real steps when they ended."""
        from rlflow.train.rollout import Stream, play

        config = self.config
        if source is None:
            if self.stream is None:  # not at construction: on a cluster the driver's environment never plays
                self.stream = Stream(self.env).start(config.seed)
            self.segments = [play(self.policy, self.stream, config.num_steps, config.gamma)]
        else:
            self.segments = source.rollouts(self.policy, config.num_steps, self.rng)
        for segment in self.segments:
            for episode in segment.episodes:
                episode = {"real_steps": self.counters["real_steps"] + episode.pop("step"), **episode}
                self.episodes.append(episode)
                if self.writer is not None:
                    self.writer.add_scalar("charts/episodic_return", episode["return"], episode["real_steps"])
                    self.writer.add_scalar("charts/episodic_length", episode["length"], episode["real_steps"])
                    self.writer.add_scalar(f"charts/speedup/{episode['model']}", episode["speedup"],
                                           episode["real_steps"])
            for name, value in segment.counters.items():
                self.counters[name] += value

    def update(self) -> dict[str, float]:
        """GAE over the last rollout, then the clipped-objective epochs; returns the losses of the last minibatch."""
        import torch
        from torch import nn


        config, policy, segments = self.config, self.policy, self.segments
        with torch.no_grad():
            advantages = torch.cat([self._advantages(segment) for segment in segments])
        values = torch.as_tensor(np.concatenate([segment.values for segment in segments]))
        returns = advantages + values
        batch = {key: torch.as_tensor(np.concatenate([segment.buffers[key] for segment in segments]))
                 for key in segments[0].buffers}
        actions = torch.as_tensor(np.concatenate([segment.actions for segment in segments]))
        logprobs = torch.as_tensor(np.concatenate([segment.logprobs for segment in segments]))
        steps = len(actions)
        indices = np.arange(steps)
        minibatch = max(1, steps // config.num_minibatches)
        clipfracs = []
        for _ in range(config.update_epochs):
            self.rng.shuffle(indices)
            for begin in range(0, steps, minibatch):
                mb = torch.as_tensor(indices[begin: begin + minibatch])
                _, newlogprob, entropy, newvalue = policy.get_action_and_value(
                    {key: value[mb] for key, value in batch.items()}, actions[mb])
                logratio = newlogprob - logprobs[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > config.clip_coef).float().mean().item())
                mb_adv = advantages[mb]
                if config.norm_adv and len(mb) > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - config.clip_coef, 1 + config.clip_coef)).mean()
                if config.clip_vloss:
                    v_unclipped = (newvalue - returns[mb]) ** 2
                    v_clipped = values[mb] + torch.clamp(newvalue - values[mb], -config.clip_coef, config.clip_coef)
                    v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns[mb]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - returns[mb]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - config.ent_coef * entropy_loss + config.vf_coef * v_loss
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                self.optimizer.step()
            if config.target_kl is not None and approx_kl > config.target_kl:
                break

        y_pred, y_true = values.numpy(), returns.numpy()
        var_y = np.var(y_true)
        return {"value_loss": v_loss.item(), "policy_loss": pg_loss.item(), "entropy": entropy_loss.item(),
                "old_approx_kl": old_approx_kl.item(), "approx_kl": approx_kl.item(),
                "clipfrac": float(np.mean(clipfracs)),
                "explained_variance": np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y}

    def _advantages(self, segment):
        """GAE over one segment: its last step bootstraps from where its own environment went next."""
        import torch

        from rlflow.env.observation import obs_to_torch

        config = self.config
        next_value = self.policy.get_value(obs_to_torch(segment.next_obs)).item()
        advantages = torch.zeros(len(segment.actions))
        last = 0.0
        for t in reversed(range(len(segment.actions))):
            if t == len(segment.actions) - 1:
                nonterminal, following = 1.0 - segment.next_done, next_value
            else:
                nonterminal, following = 1.0 - float(segment.dones[t + 1]), float(segment.values[t + 1])
            delta = float(segment.rewards[t]) + config.gamma * following * nonterminal - float(segment.values[t])
            last = delta + config.gamma * config.gae_lambda * nonterminal * last
            advantages[t] = last
        return advantages

    def set_learning_rate(self, update: int, num_updates: int) -> None:
        """CleanRL's linear annealing to 0 (when `anneal_lr`)."""
        if self.config.anneal_lr:
            self.optimizer.param_groups[0]["lr"] = (1.0 - (update - 1.0) / num_updates) * self.config.learning_rate


def main(config: Config) -> dict:
    """Trains, evaluates and writes the results; returns what ppo.json holds."""
    from rlflow.agents.policy import CandidatePolicy, save_checkpoint
    from rlflow.measure.costmodel.gpu_estimate import cost_model_for, estimated_only
    from rlflow.rewrites import REGISTRY_VERSION, RULES

    wall_start = time.monotonic()
    cost_model = cost_model_for(config.provider)
    estimated = estimated_only(cost_model, measuring=config.reward == "measure")
    if estimated:
        config = dataclasses.replace(config, evaluate=False)
    seed_everything(config.seed, config.threads)
    out, run_dir = Path(config.out), Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = CsvWriter(run_dir / "metrics.csv")

    paths = resolve_models(config.models, config.zoo_dir)
    env = make_env(paths, config, cost_model)
    rng = np.random.default_rng(config.seed)
    baseline_returns = random_episodes(env, config.baseline_episodes, rng) if config.baseline_episodes else []
    baseline = float(np.mean(baseline_returns)) if baseline_returns else None
    if baseline is not None:
        print(f"uniformly random policy: mean return {baseline:.2f} over {len(baseline_returns)} episodes", flush=True)

    policy = CandidatePolicy(len(RULES), config.hidden, config.rounds)
    policy.config = asdict(config)  # the agent search (evaluation) plays the scope it was trained in
    num_updates = max(1, config.total_steps // config.num_steps)
    # the random episodes above are real steps too, but not training: the counters restart here
    learner = Learner(policy, env, config, rng, writer)
    remote = None  # the rollouts on a Ray cluster (rlflow.train.cluster), else here
    if config.ray is not None:
        from rlflow.train.cluster import RayRollouts

        remote = RayRollouts(config.ray, paths, config, estimated)
        print(f"rollouts on the Ray cluster '{config.ray}': {len(remote.pool)} nodes of this machine's kind, "
              f"{config.num_steps // len(remote.pool)}+ steps each per update", flush=True)
    stop_reason = "total steps"
    print(f"training on {len(paths)} models, {num_updates} updates of {config.num_steps} steps, "
          f"{len(RULES)} rules", flush=True)
    update = 0
    for update in range(1, num_updates + 1):
        if config.time_limit is not None and time.monotonic() - wall_start > config.time_limit:
            stop_reason = "time limit"
            break
        learner.set_learning_rate(update, num_updates)
        learner.collect(remote)
        losses = learner.update()
        real = learner.counters["real_steps"]
        writer.add_scalar("charts/learning_rate", learner.optimizer.param_groups[0]["lr"], real)
        writer.add_scalar("charts/real_steps", real, real)
        writer.add_scalar("charts/measurements", learner.counters["measurements"], real)
        for name, value in losses.items():
            writer.add_scalar(f"losses/{name}", value, real)
        recent = [e["return"] for e in learner.episodes[-3 * len(paths):]]
        elapsed = time.monotonic() - wall_start
        print(f"update {update}/{num_updates}  real steps {real}  episodes {len(learner.episodes)}  "
              f"mean return {np.mean(recent) if recent else float('nan'):+.2f}  entropy {losses['entropy']:.2f}  "
              f"{elapsed:.0f}s", flush=True)
        if update % config.checkpoint_every == 0:
            save_checkpoint(run_dir / "ppo.pt", policy, learner.optimizer, asdict(config), real_steps=real,
                            update=update)
        cost_model.save()

    train_seconds = time.monotonic() - wall_start
    checkpoint = save_checkpoint(run_dir / "ppo.pt", policy, learner.optimizer, asdict(config),
                                 real_steps=learner.counters["real_steps"], update=update)
    cost_model.save()
    episodes = learner.episodes
    recent_episodes = episodes[-3 * len(paths):]
    result = {
        "algo": "ppo",
        "config": asdict(config),
        "registry_version": REGISTRY_VERSION,
        "rules": len(RULES),
        "train": {
            **learner.counters,
            "episodes": len(episodes),
            "seconds": train_seconds,
            "stop_reason": stop_reason,
            "random_policy_mean_return": baseline,
            "final_mean_return": float(np.mean([e["return"] for e in recent_episodes])) if recent_episodes else None,
            "checkpoint": str(checkpoint),
        },
        "curve": [{k: e[k] for k in ("real_steps", "model", "return")} for e in episodes],
    }
    if remote is not None:
        result["cluster"] = remote.report()
        remote.close()
    if config.evaluate:
        from rlflow.train.evaluate import evaluate_results

        evaluate_results(result, policy, config, cost_model, writer)
    cost_model.save()
    result["wall_seconds"] = time.monotonic() - wall_start
    write_ppo_results(result, out)
    writer.close()
    return result
