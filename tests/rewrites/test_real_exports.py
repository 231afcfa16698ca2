"""The rules on real exported graphs: a small CNN and a small transformer exported from PyTorch with both exporters
(TorchScript and dynamo), plus the zoo's BERT and ResNet "-tiny" models.  Every one of the six groups must have a rule
that matches on these exports and whose rewrite onnxruntime verifies, and every contrib fusion found on them must be
undone by its inverse.  The exports are built once per session (`conftest.py`).
"""
from __future__ import annotations

from rlflow.graph.core import Graph
from rlflow.measure.verify import verify
from rlflow.rewrites import GROUPS, apply, rule


def _verified(graph: Graph, rules, tries: int = 2) -> tuple[str, Graph] | None:
    """The first (match, new graph) among `rules` on `graph` that onnxruntime verifies, or None."""
    reference = None
    for r in rules:
        for match in r.find(graph)[:tries]:
            new = apply(graph, match)
            reference = reference or graph.to_model()
            if verify(reference, new.to_model()).ok:
                return str(match), new
            raise AssertionError(f"{match} does not verify")
    return None


def test_every_group_fires_on_real_exports(exports):
    exact = {group: rules for group, rules in GROUPS.items() if group != "precision"}  # tests/test_precision.py
    fired = {group: {} for group in exact}
    for name, graph in exports.items():
        for group, rules in exact.items():
            found = _verified(graph, rules)
            if found is not None:
                fired[group][name] = found[0]
    print({group: sorted(models) for group, models in fired.items()})
    assert all(fired.values()), {group: models for group, models in fired.items() if not models}
    for family in ("cnn", "transformer"):  # each exporter's CNN and transformer meet several groups
        for exporter in ("torchscript", "dynamo"):
            groups = [g for g, models in fired.items() if f"{family}-{exporter}" in models]
            assert len(groups) >= 3, (family, exporter, groups)


def test_transformer_exports_fuse_to_attention(exports):
    """MultiHeadAttention from both exporters' attention (the dynamo export after removing its Identity)."""
    for name in ("transformer-torchscript", "transformer-dynamo", "bert-base-tiny"):
        graph = exports[name]
        for m in rule("identity-elim").find(graph):
            graph = apply(graph, m)
        fused = _verified(graph, [rule("attention-fusion")])
        assert fused is not None, (name, [r.reason for r in rule("attention-fusion").reasons(graph)])


INVERSES = {"gelu-fusion": "gelu-unfuse", "skip-layernorm-fusion": "skip-layernorm-unfuse",
            "conv-activation-fusion": "fused-conv-unfuse", "gemm-activation-fusion": "fused-gemm-unfuse",
            "matmul-transpose-fusion": "fused-matmul-unfuse", "attention-fusion": "attention-unfuse",
            "matmul-merge-siblings": "matmul-split-unmerge", "conv-merge-siblings": "conv-split-unmerge",
            "matmul3d-add-to-gemm": "gemm-reshape-to-matmul", "matmul-add-to-gemm": "gemm-to-matmul-add"}


def test_fusions_on_real_exports_can_be_undone(exports):
    undone = set()
    for name, graph in exports.items():
        for forward, backward in INVERSES.items():
            if forward in undone:
                continue
            found = _verified(graph, [rule(forward)], tries=1)
            if found is None:
                continue
            back = _verified(found[1], [rule(backward)], tries=1)
            assert back is not None, (name, forward, [r.reason for r in rule(backward).reasons(found[1])])
            undone.add(forward)
    assert len(undone) >= 8, sorted(undone)
