"""What every trainer shares: deterministic seeding and atomic checkpoint writes."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np


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
