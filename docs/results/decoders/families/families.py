"""Which decoder families' exports each tool fuses: families.json and families.md.

The zoo's decoders are Llama (SmolLM2) and Qwen3.  A rule that matches what one family's export writes may miss
another's (Gemma's `1 + w` norm scale and GELU MLP, Phi's partial rotary embedding and LayerNorm, OLMo2's norms after
the projections, Gemma3's and Mistral's sliding windows), and the peers' issue trackers are full of such misses.  This
builds each family from its transformers configuration at a test size (2 layers, hidden 64, 4 heads, 2 KV heads,
head size 16, random weights), exports its one-token decode step with a 16-token cache by both torch exporters (as
`rlflow zoo build` exports the zoo's decoders), and its prefill of 16 tokens, and gives each tool's output:

- what is left decomposed: normalisations (`ReduceMean`), rotary embeddings (`Neg`), attention (`Softmax`);
- the fused operators it made, and its node count;
- whether it computes what the export does, at the deployed shape and at another (batch 2, past 40 or 24 tokens:
  `verify`).

Tools: rlflow's all-fusions graph (every fusion rule wherever it matches, as the search's first candidate),
onnxscript's fusions for onnxruntime (`onnxscript-ort`) and onnxruntime's transformers optimizer (`ort-transformers`,
model type `gpt2` as onnxruntime's own Llama export uses, `qwen3` for Qwen3).  Structure only: a test-size model says
which patterns a tool matches, not what the match is worth; speed is in ../README.md's tables.

    python docs/results/decoders/families/families.py            # about 6 minutes on 2 cores
"""
from __future__ import annotations

import datetime
import itertools
import json
import time
import warnings
from pathlib import Path

import onnx
import onnxruntime
import transformers

from rlflow.bench.peers import onnxscript_ort, ort_transformers
from rlflow.graph.core import Graph
from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.measure.verify import verify
from rlflow.search.candidates import Candidate, all_fusions
from rlflow.zoo import decoders
from rlflow.zoo.decoder_architectures import DecoderArchitecture

here = Path(__file__).resolve().parent
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = {  # key: (transformers class, configuration over TINY, model type for ort-transformers, what sets it apart)
    "llama": ("LlamaForCausalLM", dict(rms_norm_eps=1e-5), "gpt2", "SmolLM2, Llama 3: the zoo's"),
    "qwen3": ("Qwen3ForCausalLM", dict(rms_norm_eps=1e-6), "qwen3", "q/k norms: the zoo's"),
    "qwen2": ("Qwen2ForCausalLM", dict(rms_norm_eps=1e-6), "gpt2", "biased q/k/v projections"),
    "mistral": ("MistralForCausalLM", dict(rms_norm_eps=1e-5, sliding_window=None), "gpt2", "Llama's layout"),
    "gemma": ("GemmaForCausalLM", dict(rms_norm_eps=1e-6), "gpt2", "norm scale 1 + w, GELU-tanh MLP, scaled embeddings"),
    "gemma3": ("Gemma3ForCausalLM", dict(rms_norm_eps=1e-6, sliding_window=64), "gpt2",
               "q/k norms, four norms a layer, sliding-window layers (window 64, past under it)"),
    "phi3": ("Phi3ForCausalLM", dict(rms_norm_eps=1e-5, tie_word_embeddings=False), "gpt2",
             "packed qkv and gate/up projections, rotary written as partial"),
    "phi4-mini": ("Phi3ForCausalLM", dict(rms_norm_eps=1e-5, partial_rotary_factor=0.75), "gpt2",
                  "Phi-3's layout, rotary over 3/4 of each head"),
    "olmo2": ("Olmo2ForCausalLM", dict(rms_norm_eps=1e-6), "gpt2", "norms after attention and MLP, q/k norms"),
    "granite": ("GraniteForCausalLM", dict(rms_norm_eps=1e-6), "gpt2", "scaled residuals, logits and attention"),
    "stablelm": ("StableLmForCausalLM", dict(partial_rotary_factor=0.25), "gpt2", "LayerNorm, rotary over 1/4"),
    "phi2": ("PhiForCausalLM", dict(partial_rotary_factor=0.5), "gpt2",
             "LayerNorm, parallel attention and MLP, GELU, rotary over 1/2"),
}
EXPORTERS = ("dynamo", "ts")
KINDS = {"decode": (16, (2, 40)), "prefill": (16, (2, 24))}  # kind: (deployed cache or prompt length, another (batch, length))
LEFT = {"norm": "ReduceMean", "rotary": "Neg", "attention": "Softmax"}
FUSED = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
         "SkipLayerNormalization", "RotaryEmbedding", "GroupQueryAttention", "MultiHeadAttention", "Attention",
         "FastGelu", "Gelu", "BiasGelu")


def _shapes(arch: DecoderArchitecture, kind: str, batch: int, length: int) -> dict:
    return {name: (batch, *shape[1:]) for name, shape in decoders.input_shapes(arch, kind, length).items()}


def export(key: str, kind: str, exporter: str) -> tuple[onnx.ModelProto, list]:
    """The export and the shapes it is checked at: deployed, then another."""
    model, config, _, _ = FAMILIES[key]
    arch = DecoderArchitecture(f"{key}-tiny", model, dict(TINY, **config), {}, key, tiny=True)
    data, _ = decoders.export_decoder(arch, kind, exporter)
    proto = onnx.load_from_string(data)
    proto.ir_version = min(proto.ir_version, 10)
    length, other = KINDS[kind]
    shapes = [_shapes(arch, kind, 1, length), _shapes(arch, kind, *other)]
    proto.metadata_props.add(key=DEPLOYED_SHAPES_KEY, value=format_input_shapes(shapes[0]))
    return proto, shapes


def tools(key: str) -> dict:
    hints = dict(model_type=FAMILIES[key][2], num_heads=TINY["num_attention_heads"], hidden_size=TINY["hidden_size"])

    def rlflow_all_fusions(model):
        graph = Graph.from_model(model)
        return all_fusions(Candidate(graph, (), graph.fingerprint())).graph.to_model(static=False)

    return {"rlflow all-fusions": rlflow_all_fusions, "onnxscript-ort": onnxscript_ort,
            "ort-transformers": lambda model: ort_transformers(model, hints=hints)}


def describe(model: onnx.ModelProto, output: onnx.ModelProto, shapes: list) -> dict:
    ops: dict[str, int] = {}
    for node in output.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    check = verify(model, output, seeds=(0,), shapes=shapes)
    return {"nodes": len(output.graph.node), "left": {part: ops.get(op, 0) for part, op in LEFT.items()},
            "fused": {op: ops[op] for op in FUSED if op in ops}, "verified": check.ok,
            **({} if check.ok else {"error": check.message.splitlines()[0][:300]})}


def main() -> dict:
    out = {"what": __doc__.split("\n\n")[0], "date": datetime.date.today().isoformat(),
           "versions": {"transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__,
                        **{name: __import__(name).__version__ for name in ("onnxscript", "torch", "onnx")}},
           "shapes": {kind: f"batch 1, {length} tokens (decode: cached); checked there and at batch {other[0]}, "
                            f"{other[1]} tokens" for kind, (length, other) in KINDS.items()},
           "families": {}}
    for key, (model_class, _, _, note) in FAMILIES.items():
        for kind, exporter in itertools.product(KINDS, EXPORTERS):
            started = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, shapes = export(key, kind, exporter)
            found = {"export": describe(model, model, shapes)}
            for name, tool in tools(key).items():
                try:
                    found[name] = describe(model, tool(model), shapes)
                except Exception as exc:  # noqa: BLE001 - a tool that fails gets its row
                    found[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            out["families"][f"{key}-{kind}-{exporter}"] = {"class": model_class, "note": note, "tools": found}
            print(f"{key}-{kind}-{exporter}: " + "; ".join(
                f"{name} {row.get('nodes', '-')} nodes, left {row.get('left')}, "
                f"{'verified' if row.get('verified') else row.get('error', 'NOT verified')}"
                for name, row in found.items()) + f" ({time.monotonic() - started:.0f} s)", flush=True)
    (here / "families.json").write_text(json.dumps(out, indent=1) + "\n")
    (here / "families.md").write_text(table(out))
    return out


def table(out: dict) -> str:
    names = [n for n in next(iter(out["families"].values()))["tools"] if n != "export"]
    lines = ["# Decoder families: what each tool leaves decomposed", "",
             f"Generated by `families.py` on {out['date']} ({', '.join(f'{k} {v}' for k, v in out['versions'].items())}"
             f"); the decode step at a cache of {KINDS['decode'][0]}, the prefill of {KINDS['prefill'][0]} tokens, "
             "each checked at batch 1 and 2. Each cell: norms / rotary embeddings / attentions left decomposed (`ReduceMean`, "
             "`Neg`, `Softmax` nodes), then the node count; **bold** where nothing is left; `wrong` where the output "
             "does not compute what the export does, `failed` where the tool failed.", "",
             "| family | step | exporter | what sets it apart | export | " + " | ".join(names) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for name, row in out["families"].items():
        key, kind, exporter = name.rsplit("-", 2)
        cells = []
        for tool in ["export", *names]:
            found = row["tools"][tool]
            if "nodes" not in found:
                cells.append("failed")
                continue
            left = found["left"]
            text = f"{left['norm']} / {left['rotary']} / {left['attention']}, {found['nodes']}"
            cells.append("wrong" if not found["verified"] else f"**{text}**" if not any(left.values()) else text)
        lines.append(f"| {key} | {kind} | {exporter} | {row['note']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
