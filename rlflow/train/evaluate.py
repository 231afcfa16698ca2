"""A trained policy against the random-walk baseline, measured end to end: the acceptance check of the agent.

Per model, two searches get the same measurement budget (the `top_k` graphs they rank best measured end to end, the
fastest measurably-faster one kept, else the input): the agent (`rlflow.search.agent`: policy rollouts propose the
graphs) and the random walk (`rlflow.search.random_walk`: uniformly random rewrites propose them, the cost model
ranks).  Their two results are then measured against the original and head to head, interleaved; the outcome is a win
or a loss only when the head-to-head interval excludes 1.  The greedy policy's own episode (no measurement at all) is
reported too, with its return and its cost-model estimate.

Training writes `ppo.json` without this section when run with `--no-evaluate`; this module adds it later:

    rlflow evaluate --checkpoint build/agent/run/ppo.pt --results build/agent/ppo.json \\
        --out docs/results
"""
from __future__ import annotations

import json
import shlex
import time
import typing
from pathlib import Path

import numpy as np


def rollout_greedy(policy, env, index: int):
    """One greedy episode on model `index`: (final graph, applied rewrites, return, steps)."""
    import torch

    from rlflow.env.observation import obs_to_torch

    obs, info = env.reset(options={"model": index})
    total, done = 0.0, False
    while not done:
        with torch.no_grad():
            action, *_ = policy.get_action_and_value(obs_to_torch(obs), greedy=True)
        obs, reward, terminated, truncated, info = env.step(int(action.item()))
        total += reward
        done = terminated or truncated
    return env.graph, list(env.applied), total, info["episode_steps"]


def evaluate(policy, paths: typing.Sequence[Path], config, cost_model, writer=None, step: int = 0,
             heldout: typing.Sequence[bool] | None = None) -> list[dict]:
    """Agent search vs random walk on each model (see the module docstring); `config` is a PPO `Config`."""
    from rlflow.measure.timing import compare
    from rlflow.search import RandomConfig, random_walk
    from rlflow.search.agent import AgentConfig, agent_search
    from rlflow.train.common import make_env

    heldout = heldout or [False] * len(paths)
    env = make_env(paths, config, cost_model)
    rows = []
    for index, path in enumerate(paths):
        graph, applied, ret, steps = rollout_greedy(policy, env, index)
        original = env._load(index)
        base_cost = cost_model.graph_cost(original)
        start = time.monotonic()
        agent = agent_search(original, env.settings, AgentConfig(length=config.max_episode_steps, top_k=6,
                                                                  time_limit=config.eval_time_limit,
                                                                  seed=config.seed, fuse_everything=False),
                             cost_model=cost_model, policy=policy)
        agent_seconds = time.monotonic() - start
        start = time.monotonic()
        walk = random_walk(original, env.settings, RandomConfig(walks=config.eval_walks,
                                                                length=config.max_episode_steps,
                                                                time_limit=config.eval_time_limit, seed=config.seed),
                           cost_model=cost_model)
        walk_seconds = time.monotonic() - start
        models = [original.to_model(static=True), agent.graph.to_model(static=True),
                  walk.graph.to_model(static=True), graph.to_model(static=True)]
        comparison = compare(models, env.settings, rounds=config.eval_rounds, seed=config.seed,
                             labels=["original", "agent", "random-walk", "greedy-policy"])
        a_ratio, w_ratio, g_ratio = comparison.ratios[1:]
        same = agent.graph.fingerprint() == walk.graph.fingerprint()
        head_to_head = None
        if same:
            outcome = "tie"
        else:  # agent against random walk directly, with its own interval: noise must not decide
            head_to_head = compare([models[2], models[1]], env.settings, rounds=config.eval_rounds,
                                   seed=config.seed, labels=["random-walk", "agent"]).ratios[1]
            outcome = "win" if head_to_head.faster else "loss" if head_to_head.slower else "tie"
        row = {
            "model": env.model_name(index),
            "heldout": bool(heldout[index]),
            "nodes": len(original),
            "policy": {"applied": [str(m) for m in applied], "return": ret, "steps": steps,
                       "estimated_speedup": base_cost / cost_model.graph_cost(graph), "measured": g_ratio.as_dict()},
            "agent": _search_row(agent, agent_seconds, a_ratio, base_cost, cost_model),
            "random_walk": _search_row(walk, walk_seconds, w_ratio, base_cost, cost_model),
            "same_graph": same,
            "agent_over_random_walk": head_to_head.as_dict() if head_to_head is not None else None,
            "outcome": outcome,
            "original_ms": comparison.timings[0].median_ms,
        }
        rows.append(row)
        if writer is not None:
            writer.add_scalar(f"eval/{row['model']}/agent_speedup", a_ratio.median, step)
            writer.add_scalar(f"eval/{row['model']}/random_walk_speedup", w_ratio.median, step)
        print(f"  {row['model']:<24} agent {a_ratio} ({len(agent.applied)} rewrites, {agent_seconds:.0f}s)  "
              f"random walk {w_ratio} ({len(walk.applied)} rewrites, {walk_seconds:.0f}s)  greedy policy "
              f"{g_ratio.median:.3f}x  -> {outcome}{'  [held out]' if row['heldout'] else ''}", flush=True)
    return rows


def _search_row(result, seconds: float, ratio, base_cost: float, cost_model) -> dict:
    return {"applied": [str(m) for m in result.applied], "measured": ratio.as_dict(), "seconds": seconds,
            "estimated_speedup": base_cost / cost_model.graph_cost(result.graph),
            "cost_evaluations": result.candidates_estimated, "measured_candidates": result.candidates_measured,
            "stop_reason": result.stop_reason}


def summarize(rows: typing.Sequence[dict]) -> dict:
    """Outcome counts and mean speedups, for the trained and the held-out models separately."""
    out = {}
    for part, chosen in (("trained", [r for r in rows if not r["heldout"]]),
                         ("heldout", [r for r in rows if r["heldout"]])):
        if not chosen:
            continue
        out[part] = {
            "models": len(chosen),
            "outcomes": {o: sum(r["outcome"] == o for r in chosen) for o in ("win", "tie", "loss")},
            "agent_geomean_speedup": _geomean([r["agent"]["measured"]["median"] for r in chosen]),
            "random_walk_geomean_speedup": _geomean([r["random_walk"]["measured"]["median"] for r in chosen]),
            "greedy_policy_geomean_speedup": _geomean([r["policy"]["measured"]["median"] for r in chosen]),
            "agent_mean_seconds": float(np.mean([r["agent"]["seconds"] for r in chosen])),
            "random_walk_mean_seconds": float(np.mean([r["random_walk"]["seconds"] for r in chosen])),
        }
    return out


def _geomean(values: typing.Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def evaluate_results(result: dict, policy, config, cost_model, writer=None) -> dict:
    """Adds `eval` and `summary` to a PPO results dictionary (its models, then its held-out ones)."""
    from rlflow.train.common import resolve_models

    print("evaluation: agent search vs random walk (same measurement budget), measured end to end", flush=True)
    paths = resolve_models(config.models, config.zoo_dir)
    holdout = resolve_models(config.holdout, config.zoo_dir)
    rows = evaluate(policy.eval(), list(paths) + list(holdout), config, cost_model, writer,
                    result["train"]["real_steps"], [False] * len(paths) + [True] * len(holdout))
    result["eval"] = rows
    result["summary"] = summarize(rows)
    print(f"summary: {json.dumps(result['summary'])}", flush=True)
    return result


def evaluate_checkpoint(checkpoint: str | Path, results: str | Path, out: str | Path = "docs/results",
                        command: str | None = None) -> dict:
    """`rlflow evaluate`: evaluates a checkpoint into a copy of its training results (`results`, a ppo.json); writes
    the evaluated ppo.json and the learning curve into `out`.  `command` is recorded as `eval_command` [default: the
    `rlflow evaluate` line that does the same]."""
    from types import SimpleNamespace

    from rlflow.agents.policy import load_checkpoint
    from rlflow.measure.costmodel.model import CostModel
    from rlflow.train.common import seed_everything, write_ppo_results

    wall = time.monotonic()
    result = json.loads(Path(results).read_text())
    policy, payload = load_checkpoint(checkpoint)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in result["config"].items()}
    fields.setdefault("scope", "match")  # runs from before the rule scope applied one match per action
    config = SimpleNamespace(**fields)  # the training run's PPO Config, as ppo.json recorded it
    seed_everything(config.seed, config.threads)
    cost_model = CostModel()
    evaluate_results(result, policy, config, cost_model)
    cost_model.save()
    result["eval_wall_seconds"] = time.monotonic() - wall
    result["eval_command"] = command or shlex.join(["rlflow", "evaluate", "--checkpoint", str(checkpoint),
                                                    "--results", str(results), "--out", str(out)])
    write_ppo_results(result, Path(out))
    return result
