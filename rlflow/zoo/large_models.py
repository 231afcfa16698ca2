"""Models over protobuf's 2 GB limit, built by a command rather than committed.

- `dense`: a chain of MatMul + Add -> Relu layers on [1, width] with an Identity before each MatMul (something for the
  search to remove), every weight random and dense, in one external data file.  Ten layers of 8192 make 2.5 GiB.
  The weights are written a layer at a time, so building it needs one layer's memory.
- `gpt2-large`: GPT-2 large's decode step (36 layers, hidden 1280, 3.1 GB of float32 weights, random) from
  `transformers`, exported by torch's dynamo exporter (`pip install 'rlflow[deploy]'`).

    rlflow zoo build-large dense --out DIR
    rlflow zoo build-large gpt2-large --out DIR
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from rlflow.graph.external_data import set_external_data
from rlflow.graph.model_file import max_ir_version


def dense_chain(folder: str | os.PathLike, layers: int = 10, width: int = 8192, seed: int = 0) -> Path:
    """Writes `dense.onnx` and `dense.onnx.data` into `folder`; returns the model's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data_name = "dense.onnx.data"
    weights, nodes, offset, x = [], [], 0, "x"
    with open(folder / data_name, "wb") as data:
        for k in range(layers):
            for name, shape, scale in ((f"W{k}", [width, width], width ** -0.5), (f"b{k}", [width], 0.1)):
                values = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)
                data.write(values.tobytes())
                tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
                set_external_data(tensor, data_name, offset, values.nbytes)
                weights.append(tensor)
                offset += values.nbytes
                del values
            nodes += [helper.make_node("Identity", [x], [f"i{k}"]),
                      helper.make_node("MatMul", [f"i{k}", f"W{k}"], [f"m{k}"]),
                      helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"]),
                      helper.make_node("Relu", [f"a{k}"], [f"r{k}"])]
            x = f"r{k}"
    graph = helper.make_graph(nodes, "dense_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version())
    path = folder / "dense.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def gpt2_large(folder: str | os.PathLike) -> Path:
    """GPT-2 large's decode step with a KV cache of 128 (36 layers, hidden 1280, 774 M parameters: 3.1 GB of float32
    weights, random), exported by torch's dynamo exporter with its weights in one external data file."""
    from rlflow.zoo.deploy import export_to_file
    from rlflow.zoo.deploy_architectures import GPT2_VOCAB, Architecture

    layers, hidden, heads = 36, 1280, 20
    past = {f"past_key_values.{i}.{kv}": (1, heads, 128, hidden // heads) for i in range(layers)
            for kv in ("key", "value")}
    arch = Architecture("gpt2-large-decode", "GPT2LMHeadModel",
                        dict(vocab_size=GPT2_VOCAB, n_layer=layers, n_embd=hidden, n_head=heads, n_positions=1024),
                        "decode", {"kv128": {"input_ids": (1, 1), "attention_mask": (1, 129), **past}}, ("logits",),
                        {"model_type": "gpt2", "num_heads": heads, "hidden_size": hidden},
                        "GPT-2 large decode step (one token, KV cache of 128)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpt2-large-decode-kv128-dynamo.onnx"
    export_to_file(arch, path)
    return path


CASES = ("dense", "gpt2-large")


def build_large(case: str, folder: str | os.PathLike) -> Path:
    """`rlflow zoo build-large CASE --out FOLDER`: builds one of `CASES` into `folder`; returns the model's path."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}: choose from {', '.join(CASES)}")
    return dense_chain(folder) if case == "dense" else gpt2_large(folder)
