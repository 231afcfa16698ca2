"""A memory guard: how much a measurement needs, and how many candidate sessions fit at once."""
from __future__ import annotations

import os

import onnx_graphsurgeon as gs

from rlflow.errors import InputError

SESSION_COPIES = 3
"""Copies of the weights one measured model costs: the proto, onnxruntime's session and its prepacked weights."""

HEADROOM = 512 * 2**20


def weight_bytes(graph) -> int:
    """Bytes of the graph's constant tensors."""
    return sum(t.values.nbytes for t in graph.gs.tensors().values() if isinstance(t, gs.Constant))


def available_bytes() -> int:
    """Memory the system can still give (MemAvailable), or a generous guess where that is unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2**40


def check_fits(graph) -> int:
    """Raises InputError when comparing the model with one candidate would not fit in memory; returns the weights' bytes.

    Two models side by side (the input and one candidate) is the least any optimisation needs.
    """
    weights = weight_bytes(graph)
    need = 2 * SESSION_COPIES * weights + HEADROOM
    available = available_bytes()
    if need > available:
        raise InputError(f"not enough memory: the model's weights take {weights / 2**30:.1f} GiB, measuring it against "
                         f"a rewritten copy needs about {need / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is free")
    return weights


def candidates_that_fit(graph, most: int) -> int:
    """How many candidates can be measured beside the model at once without running out of memory (at least 1)."""
    per_model = SESSION_COPIES * max(weight_bytes(graph), 1)
    return max(1, min(most, int((available_bytes() - HEADROOM) // per_model) - 1))
