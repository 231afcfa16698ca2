"""Turns a training run's checkpoint into the shipped agent: `rlflow/agents/default.pt` and `default.json`.

The shipped file keeps only what inference needs (weights, architecture, rule-registry and observation versions, the
training config), not the optimiser state; `default.json` says what it was trained on and which models were held
out, so reports can mark them.  `make agent` trains and ships in one go:

    python -m rlflow.controller.ship --checkpoint build/agent/run/ppo.pt --results build/agent/ppo.json
"""
from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

from rlflow.files import write_text_atomic

AGENTS_DIR = Path(__file__).resolve().parent.parent / "agents"

MAX_BYTES = 20_000_000
"""The package-data budget of the shipped agent (issue #8)."""


def ship(checkpoint: str | Path, results: str | Path, out: Path = AGENTS_DIR, name: str = "default") -> dict:
    """Writes `<out>/<name>.pt` (inference-only checkpoint) and `<out>/<name>.json` (its provenance)."""
    from rlflow.controller.policy import load_checkpoint, save_checkpoint
    from rlflow.errors import RlflowError

    policy, payload = load_checkpoint(checkpoint)
    run = json.loads(Path(results).read_text())
    config = payload["config"]
    path = save_checkpoint(out / f"{name}.pt", policy, None, config, real_steps=payload.get("real_steps"))
    size = path.stat().st_size
    if size > MAX_BYTES:
        path.unlink()
        raise RlflowError(f"the agent is {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB package-data budget")
    meta = {
        "checkpoint": path.name,
        "bytes": size,
        "algo": run.get("algo", "ppo"),
        "registry_version": payload["registry_version"],
        "rules": len(payload["rules"]),
        "trained_on": list(config["models"]),
        "held_out": list(config["holdout"]),
        "real_steps": run["train"]["real_steps"],
        "train_seconds": run["train"]["seconds"],
        "final_mean_return": run["train"]["final_mean_return"],
        "reproduce": "make agent",
    }
    write_text_atomic(out / f"{name}.json", json.dumps(meta, indent=1) + "\n")
    return meta


def is_held_out(model: str, out: Path = AGENTS_DIR, name: str = "default") -> bool:
    """Whether the shipped agent never trained on `model`'s architecture (a zoo name, with or without the -tiny
    suffix): any model outside its training list counts, not only the ones its run set aside (nasnet-a-mobile, for
    one, was in neither).  False when no agent metadata is there to say."""
    path = out / f"{name}.json"
    if not path.is_file():
        return False
    trained = {m.removesuffix("-tiny") for m in json.loads(path.read_text())["trained_on"]}
    return model.removesuffix("-tiny") not in trained


def main(argv: typing.Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rlflow.controller.ship", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the training run's ppo.pt")
    parser.add_argument("--results", required=True, help="the training run's ppo.json")
    parser.add_argument("--out", type=Path, default=AGENTS_DIR, help="folder of the shipped agent")
    args = parser.parse_args(argv)
    meta = ship(args.checkpoint, args.results, args.out)
    print(f"shipped {args.out / meta['checkpoint']} ({meta['bytes'] / 1e6:.2f} MB, registry "
          f"{meta['registry_version']}, held out: {', '.join(meta['held_out'])})")
    return meta


if __name__ == "__main__":
    main()
