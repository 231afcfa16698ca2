"""M retrained from scratch on finished runs' replays, once per reward target: how well each predicts the rewards of
the held-out transitions (Pearson and Spearman, and Spearman over the transitions a measurement could tell apart).

Everything but M is the run's own (V's posteriors, the location scorer's match descriptions, the split into training
and held-out episodes), so the reward target is the only difference between the rows of one run: the experiment that
chose `reward_symlog` (docs/results/archive/agent-deploy/README.md, seventh part).

    python benchmarks/agent-deploy/retrain_m.py build/quiet-table/wm{0,1,2,3}/worldmodel.pt --symlog 0,1 \
        --repeats 2 --out docs/results/agent-deploy/symlog/retrain-m.md
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from rlflow.errors import RlflowError
from rlflow.train.worldmodel.config import Config
from rlflow.train.worldmodel.learn import train_mdrnn
from rlflow.train.worldmodel.quality import MOVED, quality
from rlflow.train.worldmodel.rerun_quality import checkpoint_inputs, last_figures_episodes
from rlflow.worldmodel.mdrnn import MDRNN


def retrained(path: Path, symlog: float, seed: int) -> dict:
    """Held-out reward figures of a fresh M with `reward_symlog=symlog`, trained as the run's last iteration trained
    its own (same epochs and settings) on the run's training episodes, torch and numpy seeded with `seed`."""
    agent, payload, replay, mu, logvar, descriptors = checkpoint_inputs(path)
    names = {f.name for f in dataclasses.fields(Config)}
    config = dataclasses.replace(Config(**{k: v for k, v in payload["config"].items() if k in names}),
                                 reward_symlog=symlog)
    spec = agent.mdrnn.spec() | {"reward_knee": symlog / config.reward_scale}
    torch.manual_seed(seed)
    agent.mdrnn = MDRNN(**spec)
    agent.mdrnn_opt = torch.optim.Adam(agent.mdrnn.parameters(), lr=config.mdrnn_lr)
    held, train = last_figures_episodes(replay, payload)
    train_mdrnn(agent, replay, train, mu, logvar, config, np.random.default_rng(seed), descriptors=descriptors)
    figures = quality(agent.vision, agent.mdrnn, replay, held, train, mu, logvar, config.reward_scale, descriptors)
    return {"pearson": figures["reward_pearson"], "spearman": figures["reward_spearman"],
            "spearman_moved": figures["reward_spearman_moved"], "transitions": figures["heldout_transitions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--symlog", default="0,1",
                        help="reward_symlog values, comma-separated (0: rewards as they are)")
    parser.add_argument("--repeats", type=int, default=2, help="training seeds per value")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    knees = [float(v) for v in args.symlog.split(",")]
    command = (f"python benchmarks/agent-deploy/retrain_m.py {' '.join(map(str, args.checkpoints))} "
               f"--symlog {args.symlog} --repeats {args.repeats} --out {args.out}")
    lines = ["# M retrained on finished runs' replays, per reward target", "", f"`{command}`", "",
             "Held-out transitions of each run; `reward_symlog` 0: M learns the rewards as they are, else "
             "sign(r)·log(1 + |r|/knee) with the knee at that many % of the runtime. *moved*: real reward at least "
             f"{MOVED}% (`rlflow.train.worldmodel.quality.MOVED`). One row per training seed.", "",
             "| run | transitions | reward_symlog | seed | Pearson | Spearman | Spearman over the moved | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in args.checkpoints:
        for knee in knees:
            for seed in range(args.repeats):
                start = time.monotonic()
                try:
                    r = retrained(path, knee, seed)
                except RlflowError as exc:  # a missing or foreign checkpoint: one line, nothing written
                    raise SystemExit(f"error: {exc}") from None
                lines.append(f"| {path.parent.name} | {r['transitions']} | {knee:g} | {seed} | {r['pearson']:.3f} | "
                             f"{r['spearman']:.3f} | {r['spearman_moved']:.3f} | {time.monotonic() - start:.0f} |")
                print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
