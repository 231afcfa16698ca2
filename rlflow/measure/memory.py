"""A memory guard: how much a measurement needs, and how many candidate sessions fit at once."""
from __future__ import annotations

import functools
import os

import onnx_graphsurgeon as gs

from rlflow.errors import InputError
from rlflow.graph.external_data import is_mapped

SESSION_COPIES = 3
"""Copies of the weights one measured model costs: the proto, onnxruntime's session and its prepacked weights."""

MAPPED_SESSION_COPIES = 1
"""The same for weights mapped from their file (external data): the proto holds none of them, but each session
holds its own copy (2.5 GiB per session on a dense 2.5 GiB MatMul chain, pre-packing on or off), unless the sessions
share them in place (`shares_weights`): then none, and the mapped pages count once for all."""

HEADROOM = 512 * 2**20

SHARE_WEIGHTS_BYTES = 2**30
"""From this many bytes of weights mapped from a file, sessions share them in place (`SessionSettings.share_weights`):
a session's own copy of 2.5 GiB of weights made the search peak at 8 GiB with three sessions alive."""


def shares_weights(graph) -> bool:
    """Whether the graph's sessions should share its mapped weights (`SHARE_WEIGHTS_BYTES`)."""
    return mapped_bytes(graph) >= SHARE_WEIGHTS_BYTES


def weight_bytes(graph) -> int:
    """Bytes of the graph's constant tensors."""
    return sum(t.values.nbytes for t in graph.gs.tensors().values() if isinstance(t, gs.Constant))


def mapped_bytes(graph) -> int:
    """Bytes of the constants mapped from a file rather than held in memory."""
    return sum(t.values.nbytes for t in graph.gs.tensors().values()
               if isinstance(t, gs.Constant) and is_mapped(t.values))


def _per_model(graph) -> tuple[int, int]:
    """(bytes one measured model needs, bytes shared by all of them: the mapped weights' pages); sessions that share
    the mapped weights in place (`shares_weights`) add no copy of them."""
    mapped = mapped_bytes(graph)
    copies = 0 if mapped >= SHARE_WEIGHTS_BYTES else MAPPED_SESSION_COPIES  # `shares_weights`, without a second walk
    return SESSION_COPIES * (weight_bytes(graph) - mapped) + copies * mapped, mapped


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
    """Raises InputError when comparing the model with one candidate would not fit in memory; returns the bytes of
    weights that comparison is predicted to hold (the run's peak, less the process itself, when candidates are measured
    one at a time).

    Two models side by side (the input and one candidate) is the least any optimisation needs.
    """
    weights = weight_bytes(graph)
    per_model, shared = _per_model(graph)
    need = 2 * per_model + shared + HEADROOM
    available = available_bytes()
    if need > available:
        raise InputError(f"not enough memory: the model's weights take {weights / 2**30:.1f} GiB, measuring it against "
                         f"a rewritten copy needs about {need / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is free")
    return need - HEADROOM


def candidates_that_fit(graph, most: int) -> int:
    """How many candidates can be measured beside the model at once without running out of memory (at least 1)."""
    per_model, shared = _per_model(graph)
    return max(1, min(most, int((available_bytes() - HEADROOM - shared) // max(per_model, 1)) - 1))


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (what `/usr/bin/time -f %M` reports; mapped file pages count)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed_memory() -> None:
    """Collects Python's garbage and hands what the C heap holds free back to the system (glibc's `malloc_trim`; a
    no-op elsewhere).

    A long run that builds and drops many graphs and sessions (a bench over a zoo, each model searched by several
    methods) leaves the freed memory scattered through the heap, which glibc keeps: a bench process of agent, greedy
    and TASO-style search on five encoders was resident at 12.5 GB by its last model, where each model alone peaks
    at 3-4 GB.  Called between models, it returns that memory (after one model: 1.8 to 0.9 GiB)."""
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None elsewhere; looked up once (`find_library` runs ldconfig in a subprocess)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
