"""Turns a training run's checkpoint into a shipped agent: `rlflow/checkpoints/<name>.pt` and `<name>.json`.

A world-model run (`rlflow train --algo worldmodel`) ships as `default`, the agent `rlflow optimize` uses unless given
`--agent`: V, M and the controller in the training checkpoint format (optimiser states included: a few MB) with the
dream's reward clip taken from the run's training episodes, but not the replay.  A PPO run ships as `ppo`: weights,
architecture, rule-registry and observation versions and the training config, not the optimiser state.
`<name>.json` says what the agent was trained on and which zoo models it never saw, so reports can mark them.
`make agent` and `make ppo-agent` train and ship each in one go:

    rlflow ship --checkpoint build/agent/run/worldmodel.pt --results build/agent/worldmodel.json
    rlflow ship --checkpoint build/ppo-agent/run/ppo.pt --results build/ppo-agent/ppo.json
"""
from __future__ import annotations

import json
import typing
from pathlib import Path

from rlflow.files import write_text_atomic

AGENTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

MAX_BYTES = 20_000_000
"""The package-data budget of the shipped agent: it ships inside the wheel, so its size is every user's download."""


def _within_budget(path: Path) -> int:
    """The size of the shipped checkpoint at `path`; over MAX_BYTES it is deleted and refused (RlflowError)."""
    from rlflow.errors import RlflowError

    size = path.stat().st_size
    if size > MAX_BYTES:
        path.unlink()
        raise RlflowError(f"the agent is {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB package-data budget")
    return size


def zoo_name(model: str) -> str:
    """A model a run was given, as a zoo name: a file (`models/deit-tiny-b1-ts.onnx`) by its stem, so that the
    provenance of a run given paths reads like that of one given names (`make agent`'s)."""
    return Path(model).stem if model.endswith(".onnx") else model


def ship(checkpoint: str | Path, results: str | Path, out: Path = AGENTS_DIR, name: str = "ppo") -> dict:
    """Writes `<out>/<name>.pt` (inference-only checkpoint) and `<out>/<name>.json` (its provenance)."""
    from rlflow.agents.policy import load_checkpoint, save_checkpoint

    policy, payload = load_checkpoint(checkpoint)
    run = json.loads(Path(results).read_text())
    config = payload["config"]
    path = save_checkpoint(out / f"{name}.pt", policy, None, config, real_steps=payload.get("real_steps"))
    size = _within_budget(path)
    meta = {
        "checkpoint": path.name,
        "bytes": size,
        "algo": run.get("algo", "ppo"),
        "registry_version": payload["registry_version"],
        "rules": len(payload["rules"]),
        "trained_on": [zoo_name(m) for m in config["models"]],
        "held_out": [zoo_name(m) for m in config["holdout"]],
        "provider": config.get("provider", "cpu"),
        "real_steps": run["train"]["real_steps"],
        "train_seconds": run["train"]["seconds"],
        "final_mean_return": run["train"]["final_mean_return"],
        "reproduce": "make ppo-agent",
    }
    write_text_atomic(out / f"{name}.json", json.dumps(meta, indent=1) + "\n")
    return meta


def ship_worldmodel(checkpoint: str | Path, results: str | Path, out: Path = AGENTS_DIR,
                    name: str = "default") -> dict:
    """Writes `<out>/<name>.pt` (V, M and the controller, with the dream's reward clip from the run's training
    episodes, without the replay) and `<out>/<name>.json` from a world-model run (`rlflow train --algo
    worldmodel`)."""
    from rlflow.agents.worldmodel_agent import load_checkpoint, save_checkpoint
    from rlflow.train.worldmodel.learn import dream_reward_range
    from rlflow.train.worldmodel.replay import Replay
    from rlflow.zoo import DEPLOY, names

    agent, payload = load_checkpoint(checkpoint)
    run = json.loads(Path(results).read_text())
    replay = Replay.from_state_dict(payload["replay"])
    low, high = dream_reward_range(replay.split(False), agent.n_rules)
    config = payload["config"]
    path = save_checkpoint(out / f"{name}.pt", agent, config, reward_range=(low.tolist(), high.tolist()),
                           real_steps=payload["real_steps"])
    size = _within_budget(path)
    trained = {architecture(m) for m in config["models"]}
    provider = config.get("provider", "cpu")
    meta = {
        "checkpoint": path.name,
        "bytes": size,
        "algo": "worldmodel",
        "registry_version": payload["registry_version"],
        "rules": len(payload["rules"]),
        "rules_offered": rules_matched_in(replay, payload["rules"]),
        "trained_on": [zoo_name(m) for m in config["models"]],
        "held_out": [m for m in names(include_tiny=False) + names(family=DEPLOY) if architecture(m) not in trained],
        "provider": provider,
        "real_steps": payload["real_steps"],
        "train_seconds": run.get("wall_seconds"),
        "final_mean_return": run.get("final_reward_worldmodel"),
        "reproduce": f"make {'agent-cuda' if provider == 'cuda' else 'agent'}  # {run.get('command')}",
    }
    write_text_atomic(out / f"{name}.json", json.dumps(meta, indent=1) + "\n")
    return meta


def rules_matched_in(replay, rules: typing.Sequence[str]) -> list[str]:
    """The rules that matched in at least one real state of the training run: a rule of the registry that never did
    (a decoder fusion, for an agent trained on encoders) was never played, and `rlflow optimize` does not make the
    agent its default where such a rule matches (`rlflow.optimize.options.default_method`)."""
    import numpy as np

    seen = np.any(np.stack(replay.rule_masks), axis=0) if replay.rule_masks else np.zeros(len(rules), bool)
    return [name for name, offered in zip(rules, seen) if offered]


def architecture(model: str) -> str:
    """The architecture a zoo name stands for: a deployment export's (DistilBERT-base at any sequence length, from
    either exporter), else the name without its -tiny suffix (also for names the zoo does not know).  A model file
    (`models/deit-tiny-b1-ts.onnx`, as a run trained on paths records it) stands for its stem."""
    from rlflow.zoo import DEPLOY, get

    model = zoo_name(model)
    try:
        entry = get(model)
    except ValueError:
        return model.removesuffix("-tiny")
    return dict(entry.config).get("architecture", model) if entry.family == DEPLOY else model.removesuffix("-tiny")


def is_held_out(model: str, out: Path = AGENTS_DIR, name: str = "default") -> bool:
    """Whether the shipped agent never trained on `model`'s architecture (a zoo name: -tiny or not, a deployment
    export at any shape or exporter): any model outside its training list counts, not only the ones its run set aside
    (nasnet-a-mobile, for one, was in neither).  False when no agent metadata is there to say."""
    path = out / f"{name}.json"
    if not path.is_file():
        return False
    trained = {architecture(m) for m in json.loads(path.read_text())["trained_on"]}
    return architecture(model) not in trained


def ship_checkpoint(checkpoint: str | Path, results: str | Path, out: Path = AGENTS_DIR,
                    name: str | None = None) -> dict:
    """`rlflow ship`: a world-model run's checkpoint as `ship_worldmodel` ships it (as `default`, the agent `rlflow
    optimize` uses, unless `name` says otherwise), a PPO run's as `ship` does (as `ppo`); returns the metadata."""
    from rlflow.agents.checkpoint import checkpoint_algo

    if checkpoint_algo(checkpoint) == "worldmodel":
        return ship_worldmodel(checkpoint, results, out, name or "default")
    return ship(checkpoint, results, out, name or "ppo")
