"""Interleaved comparison at every shape profile of a graph (`Graph.profiles`, see `rlflow.measure.shape_profiles`).

A graph with no profiles, or one, is measured as always: its static export.  With several, each profile is one
`compare` of the same graphs instantiated at that profile's shapes, and a graph's speedup is the weighted geometric
mean of its per-profile speedups (`rlflow.measure.shape_profiles.combine`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import onnx

from rlflow.graph.core import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import Profile, combine, instantiate
from rlflow.measure.timing import Comparison, Pace, Ratio, compare


@dataclass
class ProfiledComparison:
    """Per-profile comparisons of the same models, and each model's combined speedup over model 0."""

    profiles: list[Profile]
    comparisons: list[Comparison]
    ratios: list[Ratio]


def profile_count(graph: Graph) -> int:
    return max(1, len(graph.profiles))


def export_at(graph: Graph, profile: Profile | None) -> onnx.ModelProto:
    """The measurement model of `graph` at `profile` (None, or the graph's own static shapes: its static export)."""
    if profile is None or dict(profile.shapes) == dict(graph.input_shapes):
        return graph.to_model(static=True)
    return instantiate(graph.to_model(static=False), profile.shapes)


def compare_profiled(graphs: Sequence[Graph], settings: SessionSettings, *, rounds: int, seed: int,
                     deadline: float | None = None, pace: Pace | None = None,
                     labels: Sequence[str] | None = None) -> ProfiledComparison:
    """`compare` of `graphs` (graph 0 the baseline) at each profile of graph 0, and the combined speedups.

    Raises:
        ProviderError: onnxruntime cannot build or run one of the models at some profile.
    """
    profiles = list(graphs[0].profiles) or [None]
    comparisons = [compare([export_at(g, p) for g in graphs], settings, rounds=rounds, seed=seed, deadline=deadline,
                           pace=pace, labels=labels) for p in profiles]
    if profiles == [None]:
        return ProfiledComparison([], comparisons, comparisons[0].ratios)
    weights = [p.weight for p in profiles]
    ratios = [combine([c.ratios[i] for c in comparisons], weights) for i in range(len(graphs))]
    return ProfiledComparison(profiles, comparisons, ratios)
