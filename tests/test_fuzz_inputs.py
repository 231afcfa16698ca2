"""A seeded fuzzer over valid models: every mutation gives exit 0 with a verified output, or exit 2 with one line.

`make test` runs a short round; `make fuzz` (pytest -m slow) runs many more.  The seed of a failing case is in the
test id, so it replays exactly.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from rlflow.cli import main
from rlflow.measure.verify import verify

MUTATIONS = ("drop-initializer", "change-shape", "corrupt-bytes", "truncate", "rename-input", "swap-op", "drop-node")


def mutate(data: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """One mutation of a serialized model."""
    if kind == "corrupt-bytes":
        buffer = bytearray(data)
        for i in rng.integers(0, len(buffer), size=int(rng.integers(1, 16))):
            buffer[i] = int(rng.integers(0, 256))
        return bytes(buffer)
    if kind == "truncate":
        return data[: int(rng.integers(1, len(data)))]
    model = onnx.ModelProto()
    model.ParseFromString(data)
    graph = model.graph
    if kind == "drop-initializer" and graph.initializer:
        del graph.initializer[int(rng.integers(len(graph.initializer)))]
    elif kind == "change-shape":
        tensors = [vi for vi in graph.input if vi.type.tensor_type.shape.dim]
        if tensors and rng.random() < 0.5:
            dims = tensors[int(rng.integers(len(tensors)))].type.tensor_type.shape.dim
            dims[int(rng.integers(len(dims)))].dim_value = int(rng.integers(2, 7))
        elif graph.initializer:
            init = graph.initializer[int(rng.integers(len(graph.initializer)))]
            if init.dims:
                init.dims[int(rng.integers(len(init.dims)))] += 1
    elif kind == "rename-input" and graph.node:
        node = graph.node[int(rng.integers(len(graph.node)))]
        if node.input:
            node.input[int(rng.integers(len(node.input)))] = "fuzz_missing"
    elif kind == "swap-op" and graph.node:
        node = graph.node[int(rng.integers(len(graph.node)))]
        node.op_type = str(rng.choice(["Relu", "Sigmoid", "Add", "MatMul", "Transpose", "Conv", "NoSuchOp"]))
    elif kind == "drop-node" and graph.node:
        del graph.node[int(rng.integers(len(graph.node)))]
    return model.SerializeToString()


def run_case(source: bytes, kind: str, seed: int, tmp_path, capsys) -> None:
    rng = np.random.default_rng(seed)
    path = tmp_path / f"fuzz-{kind}-{seed}.onnx"
    path.write_bytes(mutate(source, kind, rng))
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(path), "-o", str(out), "--time-limit", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code in (0, 2), f"{kind} seed {seed}: exit {code}: {err}"
    if code == 2:
        lines = [line for line in err.strip().splitlines() if not line.startswith("WARNING")]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{kind} seed {seed}: {err}"
        assert not out.exists()
    else:
        check = verify(onnx.load(str(path)), onnx.load(str(out)), seeds=(seed,))
        assert check.ok, f"{kind} seed {seed}: {check.message}"


@pytest.fixture(scope="module")
def sources(cnn_opset9_ir3_path, transformer_path) -> dict[str, bytes]:
    return {"cnn": open(cnn_opset9_ir3_path, "rb").read(), "transformer": open(transformer_path, "rb").read()}


@pytest.mark.parametrize("seed", range(len(MUTATIONS) * 2))
def test_fuzz_short(seed, sources, tmp_path, capsys):
    name = ("cnn", "transformer")[seed % 2]
    run_case(sources[name], MUTATIONS[seed % len(MUTATIONS)], seed, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1200))
def test_fuzz_long(seed, sources, tmp_path, capsys):
    name = ("cnn", "transformer")[seed % 2]
    run_case(sources[name], MUTATIONS[seed % len(MUTATIONS)], seed, tmp_path, capsys)
