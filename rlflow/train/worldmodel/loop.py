"""The world-model agent (RLFlow's loop, done properly): real rollouts -> V and M -> controller in the dream -> repeat.

Each iteration:
1. collect real episodes on the training models: uniformly random rule-level actions at first, then the current
   controller with epsilon-random exploration; a fraction of the episodes is held out (never trains V or M);
2. train V (`GraphVAE`: graph encoder + VAE + grounding heads) on the training states, encode every state;
3. train M (`MDRNN`) on the training episodes' latent sequences (z sampled from V's posteriors);
4. train the controller (`LatentPolicy` over (z, h)) with masked PPO in the dream (`DreamBatch`), which never
   touches a real graph: the action mask is M's predicted rule availability; dreams start from the real starting
   graphs and from states of the training episodes (with M's hidden state there), last at most `dream_horizon`
   steps, and pay a pessimistic reward (ensemble mean minus `reward_penalty` times the ensemble spread, clipped to
   the range of the real rewards) so that the controller cannot profit from the world model's errors;
5. evaluate: one greedy episode per model in the real environment, played as `rlflow optimize` plays the agent
   (never back to a graph of the episode, see `avoid_revisits`; these steps count as real steps too), and the world
   model's quality on the held-out episodes.

Actions are rule types plus terminate, masked by the real availability.  In the real environment the chosen rule is
applied where the learned location scorer (`rlflow.worldmodel.location`, trained on the real transitions after V)
predicts the most: the reward plus the discounted best return the real transitions show after it (`location_gamma`);
random and exploratory actions pick a random match (with `learn_location` off: the first listed match,
`rlflow.env.observation.first_candidate`).

The loop is here (`main`); its settings are `rlflow.train.worldmodel.config.Config`, its real episodes
`rlflow.train.worldmodel.episodes` (`collect`, `evaluate_real`), its learning steps `rlflow.train.worldmodel.learn` (V,
M, the dream) and its report `rlflow.train.worldmodel.result`.

Everything the run needs to resume (weights, optimiser states, replay, curves, config, rule-registry version) is in
`<run_dir>/worldmodel.pt`; metrics (`charts/`, `losses/`, `eval/`) go to `<run_dir>/metrics.csv`; the report
(`worldmodel.json`, `worldmodel-quality.png`, `sample-efficiency.png`) goes to `<out>`, compared with the model-free
PPO results in `ppo_results`.

    rlflow train --algo worldmodel --out docs/results
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import numpy as np

from rlflow.agents.worldmodel_agent import Agent, load_checkpoint, save_checkpoint
from rlflow.errors import InputError
from rlflow.train.common import CsvWriter, make_env, resolve_models, seed_everything
from rlflow.train.worldmodel.config import Config
from rlflow.train.worldmodel.episodes import collect, evaluate_real
from rlflow.train.worldmodel.learn import dream_reward_range, make_dream, train_mdrnn, train_vision
from rlflow.train.worldmodel.result import build_result, write_report

log = logging.getLogger("rlflow")


def main(config: Config) -> dict:
    """Runs the loop, checkpoints after every iteration, writes the report; returns what worldmodel.json holds."""
    import torch
    from tqdm.auto import tqdm

    from rlflow.measure.costmodel.gpu_estimate import cost_model_for, estimated_only
    from rlflow.rewrites import REGISTRY_VERSION, RULES
    from rlflow.train.worldmodel.dream_ppo import DreamPPOConfig, train_in_dream
    from rlflow.train.worldmodel.quality import encode_all, quality
    from rlflow.train.worldmodel.replay import Replay
    from rlflow.worldmodel.location import best_returns, location_quality, match_descriptors, train_location

    if config.reward_symlog < 0:  # before anything is built or written
        raise InputError(f"reward_symlog must be >= 0 (0: M learns the rewards as they are), not "
                         f"{config.reward_symlog:g}")
    wall_start = time.monotonic()
    seed_everything(config.seed, config.threads)
    rng = np.random.default_rng(config.seed)
    out, run_dir = Path(config.out), Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = run_dir / "worldmodel.pt"

    n_rules = len(RULES)
    agent = Agent(config, n_rules)
    replay = Replay(n_rules)
    points: list[dict] = []
    history: list[dict] = []
    real_steps, start_iteration = 0, 0
    if config.resume and checkpoint_path.is_file():
        agent, payload = load_checkpoint(checkpoint_path)
        replay = Replay.from_state_dict(payload["replay"])
        points, history = payload["points"], payload["history"]
        real_steps, start_iteration = payload["real_steps"], payload["iteration"] + 1
        rng = np.random.default_rng()
        rng.bit_generator.state = payload["rng"]
        torch.set_rng_state(payload["torch_rng"])
        print(f"resumed from {checkpoint_path}: iteration {start_iteration}, {real_steps} real steps", flush=True)
    writer = CsvWriter(run_dir / "metrics.csv")

    paths = resolve_models(config.models, config.zoo_dir)
    cost_model = cost_model_for(config.provider, cache_dir=config.cost_cache)
    estimated = estimated_only(cost_model, measuring=False)
    env_config = dataclasses.make_dataclass("EnvConfig", [("reward", str, "cost"), ("measure_every", int, 5),
                                                          ("max_episode_steps", int, config.max_episode_steps),
                                                          ("max_nodes", int, config.max_nodes),
                                                          ("max_edges", int, config.max_edges),
                                                          ("max_candidates", int, config.max_candidates),
                                                          ("scope", str, config.scope)])()
    env = make_env(paths, env_config, cost_model)
    remote = None  # the real episodes on a Ray cluster (rlflow.train.cluster), else here
    if config.ray is not None:
        from rlflow.train.cluster import RayEpisodes

        remote = RayEpisodes(config.ray, paths, env_config, config.provider, config.threads, estimated,
                             config.cost_cache)
        print(f"real episodes on the Ray cluster '{config.ray}': {len(remote.pool)} nodes of this machine's kind"
              + (f" ({len(remote.skipped)} of other kinds skipped)" if remote.skipped else ""), flush=True)
    dream_config = DreamPPOConfig(total_steps=config.dream_steps, num_envs=config.dream_envs,
                                  num_steps=config.dream_rollout, learning_rate=config.controller_lr,
                                  gamma=config.controller_gamma,
                                  ent_coef=config.ent_coef)
    print(f"world-model agent on {len(paths)} models, {config.iterations} iterations, {n_rules} rules "
          f"(actions: rule types + terminate)", flush=True)
    quality_now: dict = history[-1] if history else {}
    for iteration in range(start_iteration, config.iterations):
        it_start = time.monotonic()
        # 1. real experience
        steps = config.random_steps if iteration == 0 else config.collect_steps
        real_start = time.monotonic()
        with tqdm(total=steps, desc=f"[{iteration}] collect", leave=False, file=sys.stderr) as bar:
            acting = None if iteration == 0 else agent
            if remote is not None:
                collected = remote.collect(acting, replay, steps, config, rng, iteration=iteration, progress=bar)
            else:
                collected = collect(env, acting, replay, steps, config, rng, iteration=iteration, progress=bar)
        real_seconds = time.monotonic() - real_start
        real_steps += sum(len(e.actions) for e in collected)
        collect_returns = [e.ret for e in collected]
        train_eps, held_eps = replay.split(False), replay.split(True)
        # 2. V
        ids = replay.state_ids(train_eps)
        with tqdm(total=config.vae_epochs, desc=f"[{iteration}] V", leave=False, file=sys.stderr) as bar:
            v_losses = train_vision(agent, replay, ids, train_eps, config, rng, bar)
        mu, logvar = encode_all(agent.vision, replay)
        # 2b. where a chosen rule goes in the real graph
        l_losses: dict = {}
        if agent.location is not None:
            with tqdm(total=config.location_epochs, desc=f"[{iteration}] location", leave=False,
                      file=sys.stderr) as bar:
                l_losses = train_location(agent.location, agent.location_opt, replay, train_eps,
                                          config.location_epochs, config.vae_batch, config.reward_scale, rng, bar,
                                          gamma=config.location_gamma)
        descriptors = (match_descriptors(agent.location, replay, replay.episodes, agent.mdrnn.match_features)
                       if agent.mdrnn.match_features else None)
        # 3. M
        with tqdm(total=config.mdrnn_epochs, desc=f"[{iteration}] M", leave=False, file=sys.stderr) as bar:
            m_losses = train_mdrnn(agent, replay, train_eps, mu, logvar, config, rng, bar, descriptors)
        quality_now = quality(agent.vision, agent.mdrnn, replay, held_eps, train_eps, mu, logvar, config.reward_scale,
                              descriptors)
        if agent.location is not None:
            # held-out targets: the best returns every real episode shows (the scorer trained on its own episodes')
            values = (best_returns(replay.episodes, n_rules, config.location_gamma) if config.location_gamma > 0
                      else None)
            quality_now.update(location_quality(agent.location, replay, held_eps, config.reward_scale,
                                                config.location_gamma, values))
        quality_now["iteration"] = iteration
        history.append(quality_now)
        # 4. controller in the dream (starts: real states of the training episodes, encoded once)
        dream = make_dream(agent, train_eps, mu, logvar, config, seed=config.seed + iteration,
                           descriptors=descriptors)
        with tqdm(total=config.dream_steps, desc=f"[{iteration}] dream PPO", leave=False, file=sys.stderr) as bar:
            d_stats = train_in_dream(agent.policy, agent.policy_opt, dream, dream_config, bar)
        # 5. real evaluation
        agent.vision.eval()
        agent.mdrnn.eval()
        real_start = time.monotonic()
        if remote is not None:
            evals = remote.evaluate(agent, replay, config, rng, iteration, dream_reward_range(train_eps, n_rules))
        else:
            evals = evaluate_real(env, agent, replay, config, rng, iteration, dream_reward_range(train_eps, n_rules))
        real_seconds += time.monotonic() - real_start
        real_steps += sum(len(e.actions) for e in evals)
        point = {"iteration": iteration, "real_steps": real_steps,
                 "eval_mean_return": float(np.mean([e.ret for e in evals])),
                 "collect_mean_return": float(np.mean(collect_returns)) if collect_returns else float("nan"),
                 "eval": {e.model: {"return": e.ret, "rules": [RULES[a].name if a < n_rules else "terminate"
                                                               for a in e.actions]} for e in evals},
                 "dream_return": d_stats["dream_return"], "seconds": time.monotonic() - it_start,
                 "real_seconds": real_seconds}
        points.append(point)
        for key, value in v_losses.items():
            writer.add_scalar(f"losses/vae_{key}", value, real_steps)
        for key, value in l_losses.items():
            writer.add_scalar(f"losses/location_{key}", value, real_steps)
        for key, value in m_losses.items():
            writer.add_scalar(f"losses/mdrnn_{key}", value, real_steps)
        for key in ("policy_loss", "value_loss", "entropy"):
            writer.add_scalar(f"losses/controller_{key}", d_stats[key], real_steps)
        writer.add_scalar("charts/dream_return", d_stats["dream_return"], real_steps)
        writer.add_scalar("charts/collect_mean_return", point["collect_mean_return"], real_steps)
        writer.add_scalar("charts/real_steps", real_steps, real_steps)
        writer.add_scalar("eval/mean_return", point["eval_mean_return"], real_steps)
        for key in ("reward_pearson", "reward_spearman", "mask_accuracy", "mask_exact", "mdn_nll", "vae_kl",
                    "vae_reconstruction", "location_pearson"):
            writer.add_scalar(f"eval/{key}", quality_now.get(key, float("nan")), real_steps)
        print(f"iteration {iteration}: real steps {real_steps}  collect {point['collect_mean_return']:+.2f}  "
              f"dream {d_stats['dream_return']:+.2f}  real greedy {point['eval_mean_return']:+.2f}  "
              f"reward r {quality_now.get('reward_pearson', float('nan')):.3f}  "
              f"mask acc {quality_now.get('mask_accuracy', float('nan')):.3f} "
              f"(exact {quality_now.get('mask_exact', float('nan')):.3f})  "
              f"location r {quality_now.get('location_pearson', float('nan')):.3f}  {point['seconds']:.0f}s",
              flush=True)
        save_checkpoint(checkpoint_path, agent, config, replay=replay.state_dict(), points=points, history=history,
                        real_steps=real_steps, iteration=iteration, rng=rng.bit_generator.state,
                        torch_rng=torch.get_rng_state())
        cost_model.save()
    writer.close()
    result = build_result(config, points, history, real_steps, REGISTRY_VERSION, n_rules,
                          time.monotonic() - wall_start)
    if remote is not None:
        result["cluster"] = remote.report()
        remote.close()
    if config.report:
        write_report(result, history, points, out)
    return result
