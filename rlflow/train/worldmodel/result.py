"""What a world-model training run reports (`rlflow.train.worldmodel.loop`): the command that reproduces it,
`worldmodel.json` (headline figures, the acceptance checks against the model-free baseline, curves, the quality
history) and its plots.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rlflow.train.worldmodel.config import Config


def command_line(config: Config) -> str:
    """The command that reproduces `config` (options that differ from the defaults)."""
    defaults = Config()
    parts = ["rlflow train --algo worldmodel"]
    for f in dataclasses.fields(Config):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            parts.append(f"{flag} {','.join(value)}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _load_ppo(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def steps_to_reach(curve: list[dict], final: float | None) -> int | None:
    """Real steps until a greedy evaluation of the `curve` first reached `final` (PPO's final mean return), else None:
    issue #49's sample-efficiency figure, here for training and for benchmarks/agent-cuda/sample_efficiency.py."""
    return next((p["real_steps"] for p in curve if final is not None and p["eval_mean_return"] >= final), None)


def build_result(config: Config, points: list[dict], history: list[dict], real_steps: int, registry_version: str,
                 n_rules: int, seconds: float) -> dict:
    """What worldmodel.json holds: the headline keys, the acceptance checks, the curves and the quality history."""
    ppo = _load_ppo(config.ppo_results)
    final_q = {k: v for k, v in (history[-1] if history else {}).items() if k != "reward_pairs"}
    final_ppo = ppo["train"]["final_mean_return"] if ppo else None
    steps_ppo = ppo["train"]["real_steps"] if ppo else None
    final_wm = points[-1]["eval_mean_return"] if points else None
    reached = steps_to_reach(points, final_ppo)
    ppo_greedy = None
    if ppo and ppo.get("eval"):
        rows = [r for r in ppo["eval"] if not r["heldout"]]
        ppo_greedy = float(np.mean([r["policy"]["return"] for r in rows]))
    return {
        "algo": "worldmodel",
        "command": command_line(config),
        "reward_pearson": final_q.get("reward_pearson"),
        "reward_spearman": final_q.get("reward_spearman"),
        "reward_spearman_moved": final_q.get("reward_spearman_moved"),
        "mask_accuracy": final_q.get("mask_accuracy"),
        "real_steps_worldmodel": real_steps,
        "real_steps_ppo": steps_ppo,
        "final_reward_worldmodel": final_wm,
        "final_reward_ppo": final_ppo,
        "real_steps_worldmodel_to_reach_ppo_final": reached,
        "ppo_greedy_eval_mean_return": ppo_greedy,
        "acceptance": {
            "reward_pearson_at_least_0.8": bool(final_q.get("reward_pearson") is not None
                                                and final_q["reward_pearson"] >= 0.8),
            "reaches_ppo_final_within_one_fifth_of_its_steps": bool(
                reached is not None and steps_ppo is not None and reached <= steps_ppo / 5
                and ppo.get("registry_version") == registry_version),
        },
        "definitions": {
            "final_reward_worldmodel": "mean return of one greedy real episode per model after the last iteration",
            "final_reward_ppo": "ppo.json train.final_mean_return: mean return of PPO's last 3 x models training "
                                "episodes (sampled actions)",
            "real_steps_worldmodel": "every real environment step of the run: random and controller collection and "
                                     "the greedy evaluations",
            "real_steps_ppo": "ppo.json train.real_steps (training steps; its random-baseline episodes excluded)",
            "real_episode_seconds": "wall time of the real episodes (collection and greedy evaluations), here or on "
                                    "the Ray cluster (`cluster`: per-node episodes, with --ray)",
            "reward_pearson": "predicted vs real reward on the transitions of held-out real episodes",
            "reward_spearman": "rank correlation of the same pairs (ties share their mean rank)",
            "reward_spearman_moved": "the same over the pairs whose real reward is at least "
                                     "rlflow.train.worldmodel.quality.MOVED (% of the runtime) in size",
            "reward_pearson_agent_location": "quality: the same over the held-out transitions whose rule went where "
                                             "the location scorer chose (the dream's own kind of step)",
            "reward_pearson_random_location": "quality: the same over those whose rule went to a random match "
                                              "(exploration; which match is not in M's input)",
            "mask_accuracy": "per-rule availability predicted by M from (z, h) vs the real candidate list, per "
                             "entry over all rules, on held-out states (see mask_accuracy_seen_rules, mask_exact)",
            "location": ("actions are rule types; in the real environment a rule runs at the match the learned "
                         "location scorer rates best (random matches when exploring)" if config.learn_location else
                         "actions are rule types; a rule runs at its first listed candidate in the real environment"),
            "location_pearson": ("the location scorer's predicted vs real target on the held-out transitions: the "
                                 f"reward plus {config.location_gamma} times the best return every real episode "
                                 "shows after it" if config.location_gamma > 0 else
                                 "the location scorer's predicted vs real reward on the held-out transitions"),
        },
        "same_models_as_ppo": bool(ppo and tuple(ppo["config"]["models"]) == tuple(config.models)),
        "same_registry_as_ppo": bool(ppo and ppo.get("registry_version") == registry_version),
        "ppo_results": config.ppo_results,
        "ppo_registry_version": ppo.get("registry_version") if ppo else None,
        "ppo_config": ppo.get("config") if ppo else None,
        "ppo_curve": ppo_curve_summary(ppo),
        "quality": final_q,
        "quality_history": [{k: v for k, v in h.items() if k != "reward_pairs"} for h in history],
        "curve": points,
        "config": asdict(config),
        "registry_version": registry_version,
        "rules": n_rules,
        "wall_seconds": seconds,
        "real_episode_seconds": sum(p.get("real_seconds", 0.0) for p in points),
    }


def ppo_curve_summary(ppo: dict | None, points: int = 100) -> list[list[float]] | None:
    """PPO's rolling-mean curve (as plotted) at about `points` real-step positions: [[real_steps, mean], ...]."""
    from rlflow.train.worldmodel.quality import ppo_curve

    if not ppo or not ppo.get("curve"):
        return None
    x, y = ppo_curve(ppo["curve"], 3 * len(ppo["config"]["models"]))
    keep = np.unique(np.linspace(0, len(x) - 1, min(points, len(x))).astype(int))
    return [[float(x[i]), float(y[i])] for i in keep]


def write_report(result: dict, history: list[dict], points: list[dict], out: Path) -> None:
    """worldmodel.json, worldmodel-quality.png and sample-efficiency.png in `out`."""
    from rlflow.plots import plot_sample_efficiency, plot_world_model_quality
    from rlflow.train.worldmodel.quality import ppo_line

    out.mkdir(parents=True, exist_ok=True)
    (out / "worldmodel.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if history:
        plot_world_model_quality(history, history[-1], out / "worldmodel-quality.png")
    plot_sample_efficiency(points, ppo_line(_load_ppo(result["config"]["ppo_results"])), out / "sample-efficiency.png",
                           f"real-environment sample efficiency on {len(result['config']['models'])} -tiny models "
                           f"(cost-model reward, {result['rules']} rules)")
    print(f"wrote {out / 'worldmodel.json'}, {out / 'worldmodel-quality.png'} and {out / 'sample-efficiency.png'}: "
          f"reward Pearson {result['reward_pearson']}, mask accuracy {result['mask_accuracy']}, real steps "
          f"{result['real_steps_worldmodel']} vs PPO {result['real_steps_ppo']}, final reward "
          f"{result['final_reward_worldmodel']} vs PPO {result['final_reward_ppo']}", flush=True)


__all__ = ["build_result", "command_line", "write_report"]
