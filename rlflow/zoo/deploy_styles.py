"""Export-style variants of the deployment section's encoders (issue #49): the same models written another way.

`rlflow.zoo.deploy` exports every encoder one way per exporter (TorchScript at opset 17 with ``dynamic_axes``, dynamo
at opset 18 with ``dynamic_shapes``, the base model's outputs).  Users' export scripts differ, and an agent trained on
one script's graphs learns that script; these variants let a training set and a held-out set differ in style.  Each
style changes one or two things and keeps the rest of its exporter's recipe:

* ``static``: no dynamic axes (TorchScript without ``dynamic_axes``, dynamo without ``dynamic_shapes``), traced at the
  deployed shape, so every shape computation is folded away;
* ``nopool``: the last hidden state only (no ``pooler_output``: the pooler is dead code and neither exporter keeps it);
* ``cls``: a sequence-classification head (``<Model>ForSequenceClassification``, two labels): ``logits`` (batch, 2) out;
* ``o14`` / ``o18`` (TorchScript) and ``o17`` (dynamo): another opset than the exporter's default (at 14 TorchScript
  has no LayerNormalization and writes it as ReduceMean, Sub, Pow, Sqrt, Div);
* ``static-nopool``: both (a user's "fixed shapes, embeddings only" script).

Names extend the section's: ``<architecture>-<shape>-<exporter>-<style>`` (``bert-l4-h256-s16-ts-static``), at each
architecture's first deployed shape (``s16``, ``b1``).  The exporter description in each file's metadata says what was
done.  The code here reuses `rlflow.zoo.deploy`'s model, wrapper and input helpers, so its source is in these builds'
definition hash as well as this module's; the section's own builds do not depend on this module.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import warnings

from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.torch_threads import torch_threads
from rlflow.zoo import deploy
from rlflow.zoo.deploy_architectures import ARCHITECTURES, Architecture

ENCODER_KINDS = ("text", "image", "audio")


@dataclasses.dataclass(frozen=True)
class Style:
    """One way of writing an export.

    Attributes:
        suffix: the name's last part (``static``, ``o14``).
        exporters: the exporters (``ts``, ``dynamo``) it is made with.
        static: no dynamic axes, traced at the deployed shape.
        head: None (the base model's outputs), ``nopool`` (``last_hidden_state`` only) or ``cls`` (a
            sequence-classification head's ``logits``).
        opset: the opset, where not the exporter's default.
    """

    suffix: str
    exporters: tuple = ("ts", "dynamo")
    static: bool = False
    head: str | None = None
    opset: int | None = None

    def applies(self, arch: Architecture) -> bool:
        """Whether `arch` has this style: a pooler to drop for ``nopool``, text for ``cls``, an encoder for all."""
        if arch.kind not in ENCODER_KINDS:
            return False
        if self.head == "nopool":
            return "pooler_output" in arch.outputs
        if self.head == "cls":
            return arch.kind == "text"
        return True

    def describe(self, exporter: str) -> str:
        """The exporter description recorded in the metadata."""
        opset = self.opset or deploy.EXPORTERS[exporter][0]
        if exporter == "ts":
            text = f"torch.onnx.export (TorchScript, dynamo=False), opset {opset}, "
            text += "static shapes (no dynamic_axes)" if self.static else "dynamic_axes"
        else:
            text = f"torch.onnx.export (dynamo=True, default optimize), opset {opset}, "
            text += "static shapes (no dynamic_shapes)" if self.static else "dynamic_shapes"
        if self.head == "nopool":
            text += ", last_hidden_state only (no pooler_output)"
        elif self.head == "cls":
            text += ", ForSequenceClassification head (logits, 2 labels)"
        return text


STYLES = (
    Style("static", static=True),
    Style("nopool", head="nopool"),
    Style("cls", head="cls"),
    Style("o14", exporters=("ts",), opset=14),
    Style("o18", exporters=("ts",), opset=18),
    Style("o17", exporters=("dynamo",), opset=17),
    Style("static-nopool", static=True, head="nopool"),
)
_STYLES = {s.suffix: s for s in STYLES}
_BY_KEY = {a.key: a for a in ARCHITECTURES}


def owns(entry) -> bool:
    """Whether `entry` is one of this module's."""
    return entry.family == deploy.FAMILY and "style" in dict(entry.config)


def entries(entry_type) -> list:
    """The variants' zoo entries (``entry_type`` is ``rlflow.zoo.ZooEntry``): by architecture, style, exporter."""
    out = []
    for arch in ARCHITECTURES:
        suffix, shapes = next(iter(arch.shapes.items()))
        for style in STYLES:
            if not style.applies(arch):
                continue
            styled = styled_architecture(arch, style)
            for exporter in style.exporters:
                ints = [n for n in shapes if n in ("input_ids", "attention_mask")]
                ranges = {n: (0, arch.vocab if n == "input_ids" else 2) for n in ints}
                out.append(entry_type(
                    f"{arch.key}-{suffix}-{exporter}-{style.suffix}", deploy.FAMILY, dict(shapes), None,
                    "transformers",
                    dict(architecture=arch.key, model=styled.model, kind=arch.kind, config=styled.config,
                         exporter=exporter, opset=style.opset or deploy.EXPORTERS[exporter][0], style=style.suffix,
                         static=style.static, head=style.head),
                    input_dtypes={n: "int64" for n in ints}, input_ranges=ranges, output_names=styled.outputs,
                    description=f"{arch.description}, {suffix}, {exporter} exporter, {style.suffix}",
                    transformer=arch.transformer))
    return out


def styled_architecture(arch: Architecture, style: Style) -> Architecture:
    """`arch` with the style's outputs (and model class, for a head)."""
    if style.head == "nopool":
        return dataclasses.replace(arch, outputs=tuple(o for o in arch.outputs if o != "pooler_output"))
    if style.head == "cls":
        model = arch.model.removesuffix("Model") + "ForSequenceClassification"
        return dataclasses.replace(arch, model=model, config=dict(arch.config, num_labels=2), outputs=("logits",))
    return arch


@functools.lru_cache(maxsize=1)
def _exported(key: str, suffix: str, exporter: str, shapes: tuple):
    return export_styled(_BY_KEY[key], _STYLES[suffix], exporter, dict(shapes))


def export_styled(arch: Architecture, style: Style, exporter: str, shapes: dict):
    """(ONNX bytes, wrapped torch module) of `arch` in `style` by `exporter`; a static export is traced at `shapes`
    (the deployed shape), a dynamic one as `rlflow.zoo.deploy` traces it."""
    import torch

    from rlflow.zoo import base as zoo

    arch = styled_architecture(arch, style)
    opset = style.opset or deploy.EXPORTERS[exporter][0]
    wrapper = deploy._wrap(deploy._model(arch), arch)
    if style.static:
        gen = torch.Generator().manual_seed(zoo.SEED)
        inputs = {name: deploy._tensor(name, shape, arch, gen) for name, shape in shapes.items()}
    else:
        inputs = deploy._trace_inputs(arch)
    names, outputs = list(inputs), list(arch.outputs)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            axes = None if style.static else deploy._dynamic_axes(arch, names, tuple(outputs))
            if axes and style.head == "cls":
                axes["logits"] = {0: "batch"}
            buffer = io.BytesIO()
            torch.onnx.export(wrapper, tuple(inputs.values()), buffer, dynamo=False, opset_version=opset,
                              input_names=names, output_names=outputs, dynamic_axes=axes, do_constant_folding=True)
            data = buffer.getvalue()
        else:
            dynamic = None if style.static else deploy._dynamic_shapes(arch, names)
            program = torch.onnx.export(wrapper, tuple(inputs.values()), dynamo=True, opset_version=opset,
                                        input_names=names, output_names=outputs, dynamic_shapes=dynamic,
                                        verbose=False)
            data = program.model_proto.SerializeToString()
    wrapper.eval()  # the TorchScript exporter restores the wrapper's previous training flag
    return data, wrapper


def export(entry):
    """The zoo's ``Export`` of a variant, checked against PyTorch at the entry's deployed shape.

    Raises:
        RlflowError: transformers is not installed.
        RuntimeError: the file's opset is not the style's (dynamo's conversion down from 18 failed).
    """
    try:
        import transformers
    except ImportError:
        from rlflow.errors import RlflowError

        raise RlflowError(f"zoo model '{entry.name}' needs transformers: pip install 'rlflow[deploy]'") from None
    import onnx
    import torch

    from rlflow.zoo import base as zoo

    config = entry.config
    arch, style, exporter = _BY_KEY[config["architecture"]], _STYLES[config["style"]], config["exporter"]
    data, wrapper = _exported(arch.key, style.suffix, exporter, tuple(entry.input_shapes.items()))
    gen = torch.Generator().manual_seed(zoo.SEED + 1)
    inputs = {name: deploy._tensor(name, shape, arch, gen) for name, shape in entry.input_shapes.items()}
    with torch_threads(1), torch.no_grad():
        expected = [t.numpy() for t in wrapper(*inputs.values())]
    proto = onnx.load_from_string(data)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if opset != config["opset"]:  # dynamo exports at 18 and converts down, keeping 18 where conversion fails
        raise RuntimeError(f"zoo model '{entry.name}': the exporter wrote opset {opset}, not {config['opset']}")
    return zoo.Export(
        proto=proto, feeds={k: v.numpy() for k, v in inputs.items()}, expected=expected,
        exporter=style.describe(exporter), opset=opset,
        props={DEPLOYED_SHAPES_KEY: format_input_shapes(entry.input_shapes), "rlflow.zoo.exporter": exporter,
               "rlflow.zoo.style": style.suffix},
        metadata=dict(transformers=transformers.__version__, transformer=entry.transformer, style=style.suffix,
                      attn_implementation=wrapper.model.config._attn_implementation))
