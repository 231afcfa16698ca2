"""The deployment section's decoder-only language models (`rlflow.zoo.decoders` exports them).

A table apart from the export code, as `rlflow.zoo.deploy_architectures` is: a build's definition hash covers the
export code's source and each entry's own row through its recipe (configuration, shapes, dtype, transformer hints),
not this table, so adding a row leaves every other build up to date.

Each row is exported twice per exporter: as a prefill (the prompt in, logits and the KV cache out) and as a one-token
decode step (the KV cache in and out).  Rows at real models' shapes use those models' configurations (read from
their ``config.json`` on the Hugging Face Hub: HuggingFaceTB/SmolLM2-135M, Qwen/Qwen3-0.6B, google/gemma-3-270m);
the weights are random.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderArchitecture:
    """One decoder, exported as a prefill and as a decode step.

    Attributes:
        key: name stem (``smollm2-135m``, ``qwen3-0.6b-l8``); the entries are
            ``<key>-prefill-s<seq>-<exporter>`` and ``<key>-decode-p<past>-<exporter>``, ``-fp16`` appended for
            float16.
        model: transformers class (``LlamaForCausalLM``, ``Qwen3ForCausalLM``).
        config: keyword arguments of its configuration class.
        transformer: hints for onnxruntime's transformers optimizer and the peers (`rlflow.bench.peers`):
            model_type (a name of ``onnxruntime.transformers.optimizer.MODEL_TYPES``), num_heads, hidden_size,
            num_kv_heads, head_dim.
        description: one line for listings.
        prefill: deployed prompt lengths.
        past: deployed KV-cache lengths of the decode step.
        dtypes: ``float32`` and/or ``float16`` (``model.half()``, exported on the CPU, deployed on a GPU).
        gpu: every entry is for the GPU only (too large or slow for the CPU bench): built when named, and left out of
            `rlflow.zoo.names` unless asked for.  Float16 entries are GPU entries whatever this says.
        tiny: test-sized (left out of the full-size lists, as the research zoo's ``-tiny`` variants are).
    """

    key: str
    model: str
    config: dict
    transformer: dict
    description: str
    prefill: tuple = (128,)
    past: tuple = (128, 1024)
    dtypes: tuple = ("float32", "float16")
    gpu: bool = False
    tiny: bool = False

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def kv_shape(self) -> tuple:
        """(kv heads, head_dim) of one layer's cached keys or values."""
        return self.config["num_key_value_heads"], self.config["head_dim"]


def _hints(model_type: str, config: dict) -> dict:
    return {"model_type": model_type, "num_heads": config["num_attention_heads"], "hidden_size": config["hidden_size"],
            "num_kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"]}


# onnxruntime 1.31's transformers optimizer has no "llama" model type.  Its own LLaMA export script
# (onnxruntime/transformers/models/llama/convert_to_onnx.py) optimizes with "gpt2"; "qwen3" is the same optimizer
# class (Gpt2OnnxModel, rotary attention fusion) with other defaults (no mask, opt level 0), which the peers override.
_LLAMA_TYPE = "gpt2"

_SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                bos_token_id=0, eos_token_id=0)
_QWEN3 = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
              bos_token_id=151643, eos_token_id=151645)
# five sliding-window layers (512 tokens, rotary base 10,000) to one global one (base 1,000,000); the exporters write
# the window's cache as a Slice whose bounds hold below the window only, so its decode steps stay under 512 tokens
_GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, sliding_window=512, query_pre_attn_scalar=256,
                    layer_types=[("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(18)],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
             bos_token_id=0, eos_token_id=0)
_TINY_LLAMA = dict(_TINY, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
_TINY_QWEN3 = dict(_TINY, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

DECODERS = (
    DecoderArchitecture("smollm2-135m", "LlamaForCausalLM", _SMOLLM2, _hints(_LLAMA_TYPE, _SMOLLM2),
                        "SmolLM2-135M (Llama: L30/H576, 9 heads, 3 KV heads, SwiGLU 1536, tied embeddings)"),
    DecoderArchitecture("qwen3-0.6b-l8", "Qwen3ForCausalLM", dict(_QWEN3, num_hidden_layers=8),
                        _hints("qwen3", _QWEN3), "Qwen3-0.6B's width, 8 of its 28 layers (H1024, 16 heads, "
                                                 "8 KV heads, head_dim 128, q/k norms, tied embeddings)"),
    # the agents' training cut of the Llama family: SmolLM2's real width at a depth a training step can afford
    DecoderArchitecture("smollm2-135m-l4", "LlamaForCausalLM", dict(_SMOLLM2, num_hidden_layers=4),
                        _hints(_LLAMA_TYPE, _SMOLLM2), "SmolLM2-135M's width, 4 of its 30 layers (the agents' "
                                                       "training cut)", past=(128,)),
    DecoderArchitecture("gemma3-270m", "Gemma3ForCausalLM", _GEMMA3_270M, _hints(_LLAMA_TYPE, _GEMMA3_270M),
                        "Gemma-3-270M (L18/H640, 4 heads, 1 KV head, head_dim 256, q/k norms, sliding-window "
                        "layers, tied embeddings)", past=(128, 448)),
    # the whole model is 2.4 GB in float32, past protobuf's 2 GB that one zoo file holds: float16 only (1.2 GB)
    DecoderArchitecture("qwen3-0.6b", "Qwen3ForCausalLM", dict(_QWEN3, num_hidden_layers=28), _hints("qwen3", _QWEN3),
                        "Qwen3-0.6B (L28/H1024, 16 heads, 8 KV heads, head_dim 128, q/k norms, tied embeddings)",
                        dtypes=("float16",), gpu=True),
    # the test suite's cuts: seconds to export
    DecoderArchitecture("llama-tiny", "LlamaForCausalLM", _TINY_LLAMA, _hints(_LLAMA_TYPE, _TINY_LLAMA),
                        "Llama-style decoder (tiny: L2/H64, 4 heads, 2 KV heads)", prefill=(16,), past=(16,),
                        dtypes=("float32",), tiny=True),
    DecoderArchitecture("qwen3-tiny", "Qwen3ForCausalLM", _TINY_QWEN3, _hints("qwen3", _TINY_QWEN3),
                        "Qwen3-style decoder (tiny: L2/H64, 4 heads, 2 KV heads, q/k norms)", prefill=(16,),
                        past=(16,), dtypes=("float32",), tiny=True),
)
