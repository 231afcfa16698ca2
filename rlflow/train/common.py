"""What the trainers share, so that none imports another: seeding, the CSV metrics writer, model lists, environment
construction and the PPO results (`ppo.json` and its learning curve).  Checkpoint files are `rlflow.agents.checkpoint`.
Nothing here imports a trainer, torch or the environment at import time.
"""
from __future__ import annotations

import csv
import json
import os
import random
import time
import typing
from pathlib import Path

import numpy as np

from rlflow.files import write_text_atomic
from rlflow.plots import plot_learning_curve


def seed_everything(seed: int, threads: int) -> None:
    """Seeds Python, numpy and torch, and fixes torch's thread count (1 is the quiet setting on 2-core machines)."""
    import torch

    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------- shared by the trainers
class CsvWriter:
    """TensorBoard's `add_scalar` into a CSV file (tag, step, value, seconds): no TensorBoard dependency."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(["tag", "step", "value", "seconds"])
        self._start = time.monotonic()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._csv.writerow([tag, step, f"{float(value):.6g}", f"{time.monotonic() - self._start:.1f}"])

    def close(self) -> None:
        self._file.close()


def resolve_models(names: typing.Sequence[str], zoo_dir: str | None) -> list[Path]:
    """Paths of the models: .onnx paths as given, zoo names built (skipped when up to date) into `zoo_dir`."""
    from rlflow import zoo

    out = []
    for name in names:
        if name.endswith(".onnx") or os.sep in name:
            out.append(Path(name))
        else:
            out.append(Path(zoo.build(name, zoo_dir or zoo.default_cache_dir()).path))
    return out


def make_env(paths: typing.Sequence[Path], config, cost_model):
    """The training (or evaluation) environment over `paths` (`config`: a trainer's, with the environment fields)."""
    from rlflow.env.rewrite_env import RewriteEnv

    return RewriteEnv([str(p) for p in paths], reward=config.reward, cost_model=cost_model, settings=cost_model.settings,
                      scope=config.scope, measure_every=config.measure_every,
                      max_episode_steps=config.max_episode_steps, max_nodes=config.max_nodes,
                      max_edges=config.max_edges, max_candidates=config.max_candidates)


def write_ppo_results(result: dict, out: Path) -> None:
    """ppo.json and the learning curve (ppo-learning-curve.png) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "ppo.json", json.dumps(result, indent=1, default=str) + "\n")
    config = result["config"]
    plot_learning_curve(result["curve"], result["train"]["random_policy_mean_return"], out / "ppo-learning-curve.png",
                        f"masked PPO on {len(config['models'])} models, {config.get('reward', 'cost')} reward, "
                        f"{config.get('scope', 'match')} scope ({result['rules']} rules)")
    print(f"wrote {out / 'ppo.json'} and {out / 'ppo-learning-curve.png'}", flush=True)
