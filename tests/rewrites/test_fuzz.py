"""Seeded fuzzing: random rule sequences on small synthetic graphs and zoo "-tiny" models, every step verified.

Each step checks that every rule's `check` runs without raising, that `apply` leaves its input untouched (fingerprint
before and after), and that onnxruntime computes the same outputs as the original model.  A failure names the seed, so
`pytest -k '<graph> and <seed>'` replays it.
"""
from __future__ import annotations

import importlib.util
import logging
import math

import numpy as np
import pytest

from rlflow.graph.core import Graph
from rlflow.measure.verify import verify
from rlflow.rewrites import RULES, apply

from .helpers import graph, ints, node, other_input_sizes, weights


def _attention():
    d, heads = 16, 2
    consts = {f"w{k}": weights(d, d, seed=i) for i, k in enumerate("qkvo")}
    consts.update({f"b{k}": weights(d, seed=10 + i) for i, k in enumerate("qkv")})
    consts.update(shape=ints(0, 0, heads, d // heads), back=ints(0, 0, d), scale=np.array(math.sqrt(d // heads), np.float32))
    nodes = []
    for k in "qkv":
        nodes += [node("MatMul", ["x", f"w{k}"], f"{k}0"), node("Add", [f"{k}0", f"b{k}"], f"{k}1"),
                  node("Reshape", [f"{k}1", "shape"], f"{k}2"),
                  node("Transpose", [f"{k}2"], f"{k}3", perm=[0, 2, 3, 1] if k == "k" else [0, 2, 1, 3])]
    nodes += [node("MatMul", ["q3", "k3"], "s0"), node("Div", ["s0", "scale"], "s1"), node("Softmax", ["s1"], "p", axis=-1),
              node("MatMul", ["p", "v3"], "a0"), node("Transpose", ["a0"], "a1", perm=[0, 2, 1, 3]),
              node("Reshape", ["a1", "back"], "a2"), node("MatMul", ["a2", "wo"], "o"), node("Add", ["o", "x"])]
    return graph(nodes, {"x": ["batch", 12, d]}, consts=consts)


def _cnn():
    consts = {"w1": weights(8, 4, 1, 1), "w3": weights(6, 4, 3, 3, seed=1), "b3": weights(6), "g": weights(8, seed=2),
              "be": weights(8, seed=3), "m": weights(8, seed=4), "v": np.abs(weights(8, seed=5)) + 0.5,
              "k": weights(14, 1, 1, seed=6), "wd": weights(14, 7, 3, 3, seed=7)}
    return graph([node("Conv", ["x", "w1"], "c1"), node("BatchNormalization", ["c1", "g", "be", "m", "v"], "n1"),
                  node("Relu", ["n1"], "r1"), node("Conv", ["x", "w3", "b3"], "c3", pads=[1, 1, 1, 1]),
                  node("Relu", ["c3"], "r3"), node("Concat", ["r1", "r3"], "cat", axis=1), node("Mul", ["cat", "k"], "sc"),
                  node("Conv", ["sc", "wd"], "dw", group=2, pads=[1, 1, 1, 1]), node("Identity", ["dw"], "y")],
                 {"x": ["n", 4, 6, 6]}, consts=consts)


def _mlp():
    consts = {"w1": weights(8, 32), "b1": weights(32), "w2": weights(32, 8, seed=1), "b2": weights(8, seed=2),
              "g": weights(8, seed=3), "be": weights(8, seed=4), "r2": np.array(math.sqrt(2), np.float32),
              "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)}
    return graph([node("MatMul", ["x", "w1"], "h0"), node("Add", ["h0", "b1"], "h1"), node("Div", ["h1", "r2"], "t"),
                  node("Erf", ["t"], "e"), node("Add", ["e", "one"], "a"), node("Mul", ["h1", "a"], "m"),
                  node("Mul", ["m", "half"], "gl"), node("MatMul", ["gl", "w2"], "o0"), node("Add", ["o0", "b2"], "o1"),
                  node("Dropout", ["o1"], "o2"), node("Add", ["o2", "x"], "res"),
                  node("LayerNormalization", ["res", "g", "be"])], {"x": ["n", 8]}, consts=consts, opset=17)


def _rnn():
    consts = {f"w{i}": weights(8, 8, seed=i) for i in range(4)}
    nodes = [node("MatMul", ["x", "w0"], "a"), node("MatMul", ["h", "w1"], "b"), node("Add", ["a", "b"], "s"),
             node("Tanh", ["s"], "t"), node("MatMul", ["x", "w2"], "c"), node("MatMul", ["h", "w3"], "d"),
             node("Add", ["c", "d"], "u"), node("Sigmoid", ["u"], "g"), node("Mul", ["t", "g"], "tg"),
             node("Mul", ["h", "g"], "hg"), node("Add", ["tg", "hg"], "y")]
    return graph(nodes, {"x": ["n", 8], "h": ["n", 8]}, consts=consts)


def _layout():
    consts = {"w": weights(6, 3, 1, 1), "b": weights(6), "s": ints(0, 30, 6), "c": weights(6, seed=1)}
    return graph([node("Transpose", ["x"], "a", perm=[0, 3, 1, 2]), node("Conv", ["a", "w", "b"], "c0"),
                  node("Transpose", ["c0"], "c1", perm=[0, 2, 3, 1]), node("Relu", ["c1"], "r"),
                  node("Add", ["r", "c"], "ad"), node("Reshape", ["ad", "s"], "rs"),
                  node("Split", ["rs"], ["p", "q"], axis=1), node("Sigmoid", ["p"], "sp"), node("Sigmoid", ["q"], "sq"),
                  node("Concat", ["sp", "sq"], "y", axis=1)], {"x": ["n", 5, 6, 3]}, consts=consts)


SYNTHETIC = {"attention": _attention, "cnn": _cnn, "mlp": _mlp, "rnn": _rnn, "layout": _layout}


def fuzz(start: Graph, seed: int, steps: int, label: str) -> list[str]:
    """Applies `steps` random matches (a random rule among those that match, then a random match), verifying each."""
    rng = np.random.default_rng(seed)
    reference = start.to_model()
    other_sizes = other_input_sizes(start)  # dynamic inputs: also check the written (dynamic) models at other sizes
    written = start.to_model(static=False) if other_sizes else None
    g, applied = start, []
    for _ in range(steps):
        by_rule = {}
        for rule in RULES:
            try:
                found = rule.find(g)
            except Exception as exc:  # noqa: BLE001 - the point of the test
                raise AssertionError(f"{label} seed={seed} after {applied}: {rule.name}.check raised {exc!r}") from exc
            if found:
                by_rule[rule.name] = found
        if not by_rule:
            break
        name = sorted(by_rule)[rng.integers(len(by_rule))]
        match = by_rule[name][rng.integers(len(by_rule[name]))]
        before = g.fingerprint()
        try:
            new = apply(g, match)
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"{label} seed={seed} after {applied}: apply({match}) raised {exc!r}") from exc
        assert g.fingerprint() == before, f"{label} seed={seed}: apply({match}) modified its input"
        result = verify(reference, new.to_model(), seeds=(seed,))
        applied.append(str(match))
        assert result.ok, f"{label} seed={seed} after {applied}: {result.message}"
        if written is not None:
            result = verify(written, new.to_model(static=False), seeds=(seed,), shapes=(other_sizes,))
            assert result.ok, f"{label} seed={seed} after {applied}, at sizes {other_sizes}: {result.message}"
        g = new
    return applied


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", SYNTHETIC)
def test_fuzz_synthetic(name, seed):
    fuzz(SYNTHETIC[name](), seed, steps=8, label=name)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 13))
@pytest.mark.parametrize("name", SYNTHETIC)
def test_fuzz_synthetic_long(name, seed):
    fuzz(SYNTHETIC[name](), seed, steps=25, label=name)


def test_fuzz_exported_transformer(transformer_path):
    """A PyTorch export (opset 17, dynamic batch): the rules meet an exporter's idioms, not only ours."""
    import rlflow

    fuzz(rlflow.load(transformer_path, {"x": [2, 16, 32]}), 0, steps=20, label="transformer")


QUICK_EXPORTS = ("transformer-dynamo", "cnn-torchscript", "bert-base-tiny")
ALL_EXPORTS = ("transformer-torchscript", "transformer-dynamo", "cnn-torchscript", "cnn-dynamo", "bert-base-tiny",
               "resnet-18-tiny")


@pytest.mark.parametrize("name", QUICK_EXPORTS)
def test_fuzz_real_exports(name, exports):
    """Sequences of 20 random rewrites on real exports (both PyTorch exporters, the zoo), verified after every step."""
    applied = fuzz(exports[name], 0, steps=20, label=name)
    assert len(applied) == 20, applied


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
@pytest.mark.parametrize("name", ALL_EXPORTS)
def test_fuzz_real_exports_long(name, seed, exports):
    fuzz(exports[name], seed, steps=40, label=name)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_fuzz_exported_transformer_long(transformer_path, seed):
    import rlflow

    fuzz(rlflow.load(transformer_path, {"x": [2, 16, 32]}), seed, steps=30, label="transformer")


def _zoo():
    if importlib.util.find_spec("rlflow.zoo") is None:
        return None
    from rlflow import zoo

    return zoo if hasattr(zoo, "build") else None


_ZOO = _zoo()
TINY = [n for n in (_ZOO.names() if _ZOO else []) if n.endswith("-tiny")]
QUICK_TINY = [n for n in ("resnet-18-tiny", "bert-base-tiny") if n in TINY]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _zoo_graph(name, out_dir):
    import rlflow

    logging.getLogger("rlflow").setLevel(logging.ERROR)
    return rlflow.load(_ZOO.build(name, out_dir).path)


@pytest.mark.parametrize("name", QUICK_TINY)
def test_fuzz_zoo_quick(name, zoo_dir):
    fuzz(_zoo_graph(name, zoo_dir), 0, steps=20, label=name)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", TINY)
def test_fuzz_zoo(name, seed, zoo_dir):
    fuzz(_zoo_graph(name, zoo_dir), seed, steps=30, label=name)
