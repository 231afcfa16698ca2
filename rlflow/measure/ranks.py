"""Correlations without scipy: Pearson's, and Spearman's over tie-averaged ranks.

The cost model's checks (`rlflow.measure.costmodel.check`, `gpu_estimate`) ask whether an estimate orders graphs or groups as
measurement does, not whether it matches their values; the world model's quality report asks both of its predicted
rewards (Spearman's, which a few large rewards cannot dominate as they do Pearson's).
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman's rank correlation (ties get average ranks); NaN when either side is constant."""
    a, b = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if len(a) != len(b):
        raise ValueError("spearman needs two sequences of the same length")
    if len(a) < 2:
        return float("nan")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def rankdata(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the average of the ranks they span (as scipy.stats.rankdata's 'average')."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    ranks = np.empty(len(values), dtype=float)
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0
            start = end
    return ranks


def pearson(x: Iterable[float], y: Iterable[float]) -> float:
    """Pearson correlation of two 1-D sequences (NaN when either is constant or shorter than 2)."""
    a, b = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])
