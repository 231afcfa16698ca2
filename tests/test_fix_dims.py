"""`rlflow optimize --fix-dim`: symbolic input dimensions fixed in the output, so rules may rely on them."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from rlflow.errors import InputError
from rlflow.graph.input_shapes import fix_dims, parse_fixed_dims
from rlflow.measure.shape_profiles import parse_profile
from rlflow.optimize.pipeline import load_input
from rlflow.search.candidates import Candidate, all_fusions


def _identity(dims):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    return helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))


def _dims(vi):
    return [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]


def test_fixed_dims_parse_and_refuse_what_no_model_has():
    assert parse_fixed_dims(["batch=1", "past_sequence=128"]) == {"batch": 1, "past_sequence": 128}
    for bad in ("batch", "batch=0", "batch=-1", "=1", "batch=x"):
        with pytest.raises(InputError, match="--fix-dim"):
            parse_fixed_dims([bad])
    model = _identity(["batch", "sequence"])
    fix_dims(model, {"batch": 2})
    assert _dims(model.graph.input[0]) == [2, "sequence"] and _dims(model.graph.output[0]) == [2, "sequence"]
    with pytest.raises(InputError, match="dynamic dimensions are sequence"):
        fix_dims(model, {"batch": 1})
    with pytest.raises(InputError, match="positive integers: sequence=0"):
        fix_dims(model, {"sequence": 0})


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory):
    pytest.importorskip("transformers")
    from rlflow import zoo

    return zoo.build("llama-tiny-decode-p16-ts", tmp_path_factory.mktemp("fix-dims")).path


def test_a_decode_step_fixed_at_batch_1_takes_its_rotary_into_attention(llama_step):
    """As exported (dynamic batch, a cache that may be empty) the rotary embedding stays outside GroupQueryAttention
    (onnxruntime's kernel would rotate every row's keys by row 0's ids); with batch fixed to 1 it goes in, and the
    given model, the reference every output is verified against, is fixed too."""
    def fused(fixed):
        graph, given = load_input(llama_step, None, None, fixed)
        return all_fusions(Candidate(graph, (), graph.fingerprint())).graph.op_counts(), given

    counts, given = fused(None)
    assert counts["RotaryEmbedding"] == 4 and all(_dims(vi)[0] == "batch" for vi in given.graph.input)
    counts, given = fused({"batch": 1})
    assert "RotaryEmbedding" not in counts and counts["GroupQueryAttention"] == 2, counts
    assert all(_dims(vi)[0] == 1 for vi in [*given.graph.input, *given.graph.output])
    onnx.checker.check_model(given)



def test_a_step_deployed_at_batch_1_can_be_fixed_at_batch_2(llama_step):
    """The zoo's steps say in their metadata that they are deployed at batch 1; fixed at 2, the shapes measured and
    written follow the fixed batch (they had contradicted it: "dimension 0 is fixed to 2 in the model, not 1")."""
    from rlflow.graph.input_shapes import deployed_shapes

    graph, given = load_input(llama_step, None, None, {"batch": 2})
    assert all(shape[0] == 2 for shape in deployed_shapes(given).values())
    assert graph.shape(graph.gs.inputs[0])[0] == 2

def test_a_profile_may_repeat_a_fixed_dim_but_not_contradict_it(llama_step):
    graph, _ = load_input(llama_step, None, [parse_profile("batch=1;past_sequence=16;total_sequence=17"),
                                        parse_profile("batch=1;past_sequence=40;total_sequence=41")], {"batch": 1})
    assert [p.shapes["past_key_values.0.key"][2] for p in graph.profiles] in ([16, 40], [40, 16])
    with pytest.raises(InputError, match="batch, which --fix-dim fixes"):
        load_input(llama_step, None, [parse_profile("batch=2;past_sequence=16;total_sequence=17")], {"batch": 1})


def test_optimize_writes_the_fixed_interface_and_says_so(llama_step, tmp_path, capsys):
    from rlflow.cli import main

    out = tmp_path / "out.onnx"
    assert main(["optimize", str(llama_step), "--fix-dim", "batch=1", "--method", "greedy", "--time-limit", "2",
                 "-o", str(out)]) == 0
    assert "batch fixed to 1" in capsys.readouterr().out
    written = onnx.load(str(out), load_external_data=False)
    assert all(_dims(vi)[0] == 1 for vi in [*written.graph.input, *written.graph.output])
    assert main(["optimize", str(llama_step), "--fix-dim", "batches=1", "-o", str(tmp_path / "no.onnx")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "batches" in err and not (tmp_path / "no.onnx").exists()


def test_bench_fixes_the_dims_for_every_method_and_records_it(llama_step, tmp_path):
    import json

    from rlflow.cli import main

    out = tmp_path / "bench"
    assert main(["bench", str(llama_step), "--methods", "greedy", "--time-limit", "1", "--rounds", "3",
                 "--fix-dim", "batch=1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["fix_dims"] == {"batch": 1}
    (row,) = results["rows"]
    assert row["status"] == "ok", row
    from pathlib import Path

    from rlflow.measure.shape_profiles import load_profiled

    graph = load_profiled(Path(llama_step), [], {"batch": 1})  # what the methods and the peers are handed
    assert all(_dims(vi)[0] == 1 for vi in graph.interface[0])
    same, given = load_input(graph, None, None, {"batch": 1})  # optimize() keeps a graph handed to it fixed
    assert same is graph and all(_dims(vi)[0] == 1 for vi in given.graph.input)
    from rlflow.graph.core import load

    rebuilt, _ = load_input(load(llama_step), None, None, {"batch": 1})  # and builds one handed to it dynamic again
    assert all(_dims(vi)[0] == 1 for vi in rebuilt.interface[0])
