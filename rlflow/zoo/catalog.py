"""The zoo's catalogue of the architectures the graph-optimisation literature reports on (`literature_entries`): each
model's configuration, input shapes and published size figures, with a -tiny variant for tests.  The deployment
section's entries are `rlflow.zoo.deploy`'s."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlflow.zoo.deploy import FAMILY as DEPLOY
from rlflow.zoo.trained import FAMILY as TRAINED


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model.

    Attributes:
        name: kebab-case name, also the file stem of the built model.
        family: "cnn", "transformer" or "rnn".
        input_shapes: graph input name -> static shape (batch 1).
        published: for full models, {"params", "flops", "source"}: the published parameter count and FLOPs
            (2 x multiply-accumulates) with where they come from; None for tiny variants and the demo block.
        module: the builder module in ``models/`` (``build(config) -> torch.nn.Module``).
        config: keyword arguments of the builder.
        input_dtypes: graph input name -> numpy dtype name (float32 when absent).
        input_ranges: integer inputs -> [low, high) of their values (token ids index a vocabulary).
        output_names: names of the graph outputs.
        description: one line for listings.
        transformer: for onnxruntime's transformers optimizer (deployment entries): {"model_type", "num_heads",
            "hidden_size"}, model_type as its ``optimizer.MODEL_TYPES`` names it (decoders add "num_kv_heads" and
            "head_dim"); None elsewhere.
        gpu: for the GPU only (float16, or too large for the CPU bench): built when named, left out of
            `rlflow.zoo.names` unless asked for.
    """

    name: str
    family: str
    input_shapes: dict[str, tuple[int, ...]]
    published: dict | None
    module: str
    config: dict = field(default_factory=dict)
    input_dtypes: dict[str, str] = field(default_factory=dict)
    input_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    output_names: tuple[str, ...] = ("logits",)
    description: str = ""
    transformer: dict | None = None
    gpu: bool = False

    @property
    def tiny(self) -> bool:
        """True for test-sized entries (the ``-tiny`` variants and the demo block; in the deployment section, the
        ones whose recipe says ``tiny``, as in the trained section)."""
        if self.family in (DEPLOY, TRAINED):
            return bool(self.config.get("tiny", False))
        return self.published is None

    def dtype(self, input_name: str) -> str:
        return self.input_dtypes.get(input_name, "float32")

    def __hash__(self) -> int:  # the dict fields are not hashable; names are unique
        return hash(self.name)


def _published(params: float, gmacs: float, source: str) -> dict:
    return {"params": float(params), "flops": 2.0 * gmacs * 1e9, "source": source}


_TV = "torchvision {} weights documentation (num_params; its 'GFLOPS' figure counts multiply-accumulates)"
_IMAGE = {"x": (1, 3, 224, 224)}


def literature_entries() -> list[ZooEntry]:
    """The models of ``models/``: each full-size architecture the literature reports on, its -tiny variant, and the
    demo block."""
    def cnn(name, module, config, published, tiny_config, shape=_IMAGE, tiny_shape={"x": (1, 3, 64, 64)}, text=""):
        return [
            ZooEntry(name, "cnn", shape, published, module, config, description=text),
            ZooEntry(f"{name}-tiny", "cnn", tiny_shape, None, module, tiny_config, description=f"{text} (tiny)"),
        ]

    def tokens(seq: int, vocab: int) -> dict:
        return dict(input_shapes={"input_ids": (1, seq)}, input_dtypes={"input_ids": "int64"},
                    input_ranges={"input_ids": (0, vocab)})

    bert_tiny = dict(seq=32, vocab=1000, hidden=64, layers=2, heads=4, intermediate=256, max_positions=64)
    gpt_tiny = dict(seq=32, vocab=1000, hidden=64, layers=2, heads=4, max_positions=64)
    vit_tiny = dict(image_size=32, patch=8, hidden=64, layers=2, heads=4, intermediate=256, num_classes=10)
    return [
        *cnn("squeezenet-1.1", "squeezenet", {}, _published(1_235_496, 0.35, _TV.format("SqueezeNet1_1")),
             dict(width=0.25, num_classes=10), text="SqueezeNet 1.1, 224x224"),
        *cnn("resnet-18", "resnet", dict(block="basic", layers=[2, 2, 2, 2]),
             _published(11_689_512, 1.81, _TV.format("ResNet18")),
             dict(block="basic", layers=[1, 1, 1, 1], width=8, num_classes=10), text="ResNet-18, 224x224"),
        *cnn("resnet-50", "resnet", dict(block="bottleneck", layers=[3, 4, 6, 3]),
             _published(25_557_032, 4.09, _TV.format("ResNet50")),
             dict(block="bottleneck", layers=[1, 1, 1, 1], width=8, num_classes=10), text="ResNet-50, 224x224"),
        *cnn("resnext-50-32x4d", "resnet", dict(block="bottleneck", layers=[3, 4, 6, 3], groups=32, base_width=4),
             _published(25_028_904, 4.23, _TV.format("ResNeXt50_32X4D")),
             dict(block="bottleneck", layers=[1, 1, 1, 1], width=16, groups=4, base_width=8, num_classes=10),
             text="ResNeXt-50 (32x4d), 224x224"),
        *cnn("inception-v3", "inception", {},
             {"params": 23.9e6, "flops": 2 * 5.71e9,
              "source": "params: Keras Applications table (InceptionV3, 23.9M; torchvision's 27.2M includes the "
                        "training-only auxiliary classifier); FLOPs: " + _TV.format("Inception_V3") + ", 5.71"},
             dict(width=0.125, blocks=(1, 1, 1), num_classes=10), shape={"x": (1, 3, 299, 299)},
             tiny_shape={"x": (1, 3, 75, 75)}, text="Inception-v3, 299x299, no auxiliary head"),
        *cnn("mobilenet-v2", "mobilenet", {}, _published(3_504_872, 0.30, _TV.format("MobileNet_V2")),
             dict(width=0.25, repeats=0.34, num_classes=10), text="MobileNet-v2 1.0, 224x224"),
        *cnn("densenet-121", "densenet", dict(blocks=[6, 12, 24, 16]),
             _published(7_978_856, 2.83, _TV.format("DenseNet121")),
             dict(blocks=[2, 2, 2, 2], growth=8, init_features=16, num_classes=10), text="DenseNet-121, 224x224"),
        *cnn("nasnet-a-mobile", "nasnet", {},
             _published(5.3e6, 0.564, "Zoph et al. 2018, Learning Transferable Architectures, Table 2: "
                                      "NASNet-A (4 @ 1056), 5.3M parameters, 564M mult-adds"),
             dict(cells_per_stack=1, filters=8, stem_filters=8, image_size=64, num_classes=10),
             text="NASNet-A mobile (4 @ 1056), 224x224"),
        ZooEntry("nasrnn", "rnn", {f"x{i}": (1, 512) for i in range(5)},
                 {"params": 5.0 * 16 * 512 * 512 + 512, "flops": 2.0 * 5 * 16 * 512 * 512,
                  "source": "derived from TASO's definition (jiazhihao/TASO examples/nasrnn.py): 5 steps x 16 "
                            "(512x512) weights + a 512 initial state; 16 [1,512]x[512,512] MatMuls per step"},
                 "nasrnn", dict(hidden=512, steps=5), output_names=("h",), description="NasRNN (TASO), hidden 512, 5 steps"),
        ZooEntry("nasrnn-tiny", "rnn", {f"x{i}": (1, 64) for i in range(2)}, None, "nasrnn", dict(hidden=64, steps=2),
                 output_names=("h",), description="NasRNN (tiny)"),
        ZooEntry("bert-base", "transformer", published={"params": 110e6, "flops": 22.5e9, "source": (
            "params: Devlin et al. 2019 (BERT-base, 110M); FLOPs: Jiao et al. 2020, TinyBERT, Table 1 "
            "(BERT-base, 22.5B at sequence 128)")}, module="bert", config=dict(seq=128),
                 output_names=("last_hidden_state", "pooler_output"), description="BERT-base, sequence 128",
                 **tokens(128, 30522)),
        ZooEntry("bert-base-tiny", "transformer", published=None, module="bert", config=bert_tiny,
                 output_names=("last_hidden_state", "pooler_output"), description="BERT (tiny)", **tokens(32, 1000)),
        ZooEntry("vit-b-16", "transformer", _IMAGE, _published(86_567_656, 17.56, _TV.format("ViT_B_16")), "vit",
                 {}, description="ViT-B/16, 224x224"),
        ZooEntry("vit-b-16-tiny", "transformer", {"x": (1, 3, 32, 32)}, None, "vit", vit_tiny,
                 description="ViT (tiny)"),
        ZooEntry("gpt2-small", "transformer", published={"params": 124e6, "flops": 128 * (
            2 * 12 * 12 * 768**2 + 2 * 12 * 128 * 768 + 2 * 768 * 50257), "source": (
            "params: openai/gpt-2 README, 124M (it retracts the paper's 117M as an error); FLOPs: Kaplan et al. "
            "2020, Table 1, forward FLOPs per token 2N + 2 n_layer n_ctx d_attn + 2 d_model n_vocab (de-embedding), "
            "N = 12 n_layer d_model^2, times 128 tokens")}, module="gpt2", config=dict(seq=128),
                 description="GPT-2 small style decoder with tied LM head, sequence 128", **tokens(128, 50257)),
        ZooEntry("gpt2-small-tiny", "transformer", published=None, module="gpt2", config=gpt_tiny,
                 description="GPT-2 style decoder (tiny)", **tokens(32, 1000)),
        ZooEntry("demo-block", "transformer", {"x": (1, 32, 64)}, None, "transformer",
                 dict(layers=2, hidden=64, heads=4, seq=32), output_names=("y",),
                 description="2-layer transformer encoder, hidden 64, 4 heads, sequence 32"),
    ]
