"""What every zoo builder shares: deterministic weights, calibrated batch-norm statistics, and the ONNX export.

The export settings are the zoo's contract with the rewrite rules, so they live here, once:

* TorchScript exporter (``torch.onnx.export(..., dynamo=False)``), opset 17: fast and byte-deterministic.
* ``training=TrainingMode.PRESERVE`` on a model in eval mode.  In ``EVAL`` mode the exporter's eval peephole
  folds every BatchNormalization into the Conv before it, which would leave the BN-folding rules nothing to do;
  with ``PRESERVE`` the graph keeps inference-mode ``BatchNormalization`` nodes (``training_mode=0``).
* constant folding stays on, so Linear weights are stored pre-transposed rather than behind a ``Transpose`` node,
  and constant subgraphs (position ids, causal masks) become initializers.
"""

from __future__ import annotations

import io
import math
import warnings

import torch
from torch import nn

OPSET = 17
EXPORTER = "torch.onnx.export (TorchScript, dynamo=False, training=PRESERVE on an eval model, constant folding on)"

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)


def init_weights(model: nn.Module, seed: int, style: str) -> None:
    """Overwrites every parameter from a generator seeded with ``seed``, in registration order.

    Args:
        model: the module to initialise in place.
        seed: the seed; equal seeds give equal weights.
        style: ``"cnn"`` (He-normal convolutions, 1/sqrt(fan_in) linears) or ``"transformer"`` (N(0, 0.02)
            as in BERT and GPT-2).  Norm scales are drawn from U(0.5, 1.5) and shifts from N(0, 0.1) in both
            styles, so that no norm is an identity and no two weights are equal (the exporter would merge them).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, _NORMS):
                    if name == "weight":
                        p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                    else:
                        normal(p, 0.1)
                elif style == "transformer" or name != "weight":
                    normal(p, 0.02)
                elif isinstance(module, nn.Conv2d):
                    normal(p, math.sqrt(2.0 / (p[0].numel())))
                else:
                    normal(p, 1.0 / math.sqrt(p.shape[-1]))


def calibrate_batchnorm(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Sets every BatchNorm's running statistics to those of one forward pass over ``inputs``.

    Random weights with made-up statistics let activations grow or vanish through deep nets; measured
    statistics keep them well scaled while being far from the trivial mean 0 / variance 1.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: after one batch, the running stats are that batch's
        m.train()
    with torch.no_grad():
        model(*inputs)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()


def export(model: nn.Module, inputs: dict[str, torch.Tensor], output_names: list[str]) -> bytes:
    """The serialized ONNX model of ``model`` (in eval mode) traced on ``inputs``, with the zoo's settings."""
    model.eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice and its PRESERVE advice
        torch.onnx.export(
            model,
            tuple(inputs.values()),
            buffer,
            dynamo=False,
            opset_version=OPSET,
            input_names=list(inputs),
            output_names=output_names,
            training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=True,
        )
    return buffer.getvalue()
