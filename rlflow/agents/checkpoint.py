"""Checkpoint files of the agents: written atomically, read as weights and arrays only (never as code), and refused
with one clear line when they were trained on another rule registry or observation version."""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np


def save_checkpoint_atomic(payload: dict, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file, then a rename: an interrupted save never leaves half a checkpoint."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def checkpoint_identity(path: str | os.PathLike) -> dict:
    """Which checkpoint acted, for a results file: its path (package-relative for a shipped agent, so that results
    compare across machines) and the SHA-256 of its bytes (the commit order alone cannot tell two agents apart)."""
    path = Path(path).resolve()
    stat = path.stat()
    return {"path": shown_path(path), "sha256": _digest(str(path), stat.st_size, stat.st_mtime_ns)}


def shown_path(path: str | os.PathLike) -> str:
    """A path as results files give it: package-relative inside rlflow, as it is elsewhere."""
    path = Path(path).resolve()
    package = Path(__file__).resolve().parent.parent
    return f"rlflow/{path.relative_to(package)}" if path.is_relative_to(package) else str(path)


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file, once per (path, size, modification time): a bench plays the agent on every model."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checkpoint(path: str | os.PathLike):
    """A checkpoint file's contents, read as tensors, plain containers and numpy arrays only.

    A checkpoint is a pickle, and unrestricted unpickling runs whatever code the file names: `--agent PATH` must not
    turn a file someone hands over into a program.  So this is torch's `weights_only` loading, with numpy arrays
    allowed besides (the world model's replay holds them).

    Read once per file version (path, size, modification time): `rlflow optimize --method agent` asks a checkpoint
    its algorithm, rules and provider before loading it, and each read of a training run's checkpoint (its replay
    inside) took 1.2 s of the agent's 10 s default limit.  Callers must not modify what it returns.

    Raises:
        Exception: whatever torch.load raises for a file that is not such a checkpoint.
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _read(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read(path: str, size: int, mtime_ns: int):
    """`read_checkpoint`'s read, once per file version."""
    import torch

    torch.serialization.add_safe_globals(_array_globals())
    return torch.load(path, map_location="cpu", weights_only=True)


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
    from rlflow.env.features import OBS_VERSION
    from rlflow.errors import RlflowError
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
