"""What the trainers share, so that none imports another: seeding, checkpoint files, the CSV metrics writer, model
lists, environment construction and the PPO results (`ppo.json` and its learning curve).

The agents' own modules (`rlflow.controller.policy`, `rlflow.controller.wm_agent`) use only the checkpoint functions;
nothing here imports a trainer, torch or the environment at import time.
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


def seed_everything(seed: int, threads: int) -> None:
    """Seeds Python, numpy and torch, and fixes torch's thread count (1 is the quiet setting on 2-core machines)."""
    import torch

    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def save_checkpoint_atomic(payload: dict, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file, then a rename: an interrupted save never leaves half a checkpoint."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: str | os.PathLike):
    """A checkpoint file's contents, read as tensors, plain containers and numpy arrays only.

    A checkpoint is a pickle, and unrestricted unpickling runs whatever code the file names: `--agent PATH` must not
    turn a file someone hands over into a program.  So this is torch's `weights_only` loading, with numpy arrays
    allowed besides (the world model's replay holds them).

    Raises:
        Exception: whatever torch.load raises for a file that is not such a checkpoint.
    """
    import torch

    torch.serialization.add_safe_globals(_array_globals())
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def _array_globals() -> list:
    """What unpickling a numpy array names: its reconstructor, the array and dtype classes (no code of the file's)."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [getattr(np.dtypes, name) for name in getattr(getattr(np, "dtypes", None), "__all__", [])]
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtypes]


def checkpoint_algo(path: str | os.PathLike) -> str | None:
    """The `algo` a checkpoint file says it holds (`ppo`, `worldmodel`), or None when it says none or is no
    checkpoint at all (the loaders then refuse it with their clear message)."""
    try:
        payload = read_checkpoint(path)
    except Exception:  # noqa: BLE001 - unreadable: not ours to judge here
        return None
    return payload.get("algo") if isinstance(payload, dict) else None


def load_checkpoint_payload(path: str | os.PathLike, *, fmt: int, registry_version: str | None = None,
                            algo: str | None = None, retrain: str = "retrain", prefix: bool = False) -> dict:
    """A checkpoint's dictionary, refused with one clear line unless it fits this rlflow.

    `prefix`: also take a checkpoint trained on an earlier registry that this one extends (its rules are the first
    ones of `RULES`, which is append-only, so its rule ids still mean the same rules), for an agent that only acts:
    it acts on the rules it knows (`rlflow.search.agent.known_rules`), and adding a rule does not retire it.

    Raises:
        RlflowError: missing file, not a checkpoint (of `algo`, when given), or trained on another rule registry or
            observation version (rule ids and observation columns would mean other things).
    """
    from rlflow.errors import RlflowError
    from rlflow.features import OBS_VERSION
    from rlflow.rewrites import REGISTRY_VERSION, RULES
    from rlflow.rewrites.base import registry_version as version_of

    path = Path(path)
    if not path.is_file():
        raise RlflowError(f"{path}: no such checkpoint")
    try:
        payload = read_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not a checkpoint"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if first.startswith("Weights only load failed"):  # torch's advice to load it unrestricted is not ours
            first = "it names objects or code beyond tensors and arrays, so it was not read"
        raise RlflowError(f"{path}: not an rlflow checkpoint, or one holding more than weights and arrays "
                          f"({first})") from None
    kind = f"{algo} " if algo else ""
    if not isinstance(payload, dict) or payload.get("format") != fmt or (algo and payload.get("algo") != algo):
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise RlflowError(f"{path}: not an rlflow {kind}checkpoint (format {found})")
    expected = registry_version or REGISTRY_VERSION
    trained = RULES[:len(payload.get("rules") or [])]  # the registry it names, if this one extends it
    extended = (prefix and registry_version is None and trained and payload.get("rules") == [r.name for r in trained]
                and payload["registry_version"] == version_of(trained))
    if payload["registry_version"] != expected and not extended:
        raise RlflowError(f"{path}: trained on rule registry {payload['registry_version']} "
                          f"({len(payload['rules'])} rules), but this rlflow has registry {expected}: rule ids would "
                          f"mean other rules; {retrain}")
    if payload["obs_version"] != OBS_VERSION:
        raise RlflowError(f"{path}: trained on observation version {payload['obs_version']}, this rlflow has "
                          f"{OBS_VERSION}; {retrain}")
    return payload


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
    from rlflow.env import RewriteEnv

    return RewriteEnv([str(p) for p in paths], reward=config.reward, cost_model=cost_model, settings=cost_model.settings,
                      scope=config.scope, measure_every=config.measure_every,
                      max_episode_steps=config.max_episode_steps, max_nodes=config.max_nodes,
                      max_edges=config.max_edges, max_candidates=config.max_candidates)


def plot_curve(episodes: list[dict], baseline: float | None, path: Path, title: str) -> None:
    """Mean episode return (rolling over one pass through the models) against real environment steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        steps = np.array([e["real_steps"] for e in episodes])
        returns = np.array([e["return"] for e in episodes])
        window = max(1, min(len(returns), 3 * len({e["model"] for e in episodes})))
        kernel = np.ones(window) / window
        smooth = np.convolve(returns, kernel, mode="valid")
        ax.plot(steps, returns, ".", alpha=0.15, color="tab:blue", label="episode return")
        ax.plot(steps[window - 1:], smooth, color="tab:blue", label=f"mean of last {window} episodes")
        low = min(float(smooth.min()), baseline if baseline is not None else 0.0)
        clipped = int((returns < 1.5 * low - 5).sum())
        ax.set_ylim(1.5 * low - 5, max(float(returns.max()), 1.0) + 2)
        if clipped:
            ax.text(0.01, 0.02, f"{clipped} episodes below the axis", transform=ax.transAxes, fontsize=7)
    if baseline is not None:
        ax.axhline(baseline, color="tab:red", ls="--", label="uniformly random policy")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("real environment steps")
    ax.set_ylabel("episode return (% of initial estimated runtime saved)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_ppo_results(result: dict, out: Path) -> None:
    """ppo.json and the learning curve (ppo-learning-curve.png) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "ppo.json", json.dumps(result, indent=1, default=str) + "\n")
    config = result["config"]
    plot_curve(result["curve"], result["train"]["random_policy_mean_return"], out / "ppo-learning-curve.png",
               f"masked PPO on {len(config['models'])} models, {config.get('reward', 'cost')} reward, "
               f"{config.get('scope', 'match')} scope ({result['rules']} rules)")
    print(f"wrote {out / 'ppo.json'} and {out / 'ppo-learning-curve.png'}", flush=True)
