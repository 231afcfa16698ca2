"""torch's intra-op thread count for one block of work, restored after it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with torch on `count` threads, then puts the caller's count back (a library call must not leave
    it changed).  One thread is what the small work in rlflow wants: the agent's forward passes over graphs of a few
    hundred nodes (5x slower on two threads of a busy 2-core machine) and the zoo's bit-identical batch-norm
    calibration (`rlflow.zoo.deploy` keeps its own copy: its source is part of every deployment export's definition
    hash, so editing it rebuilds them all)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["torch_threads"]
