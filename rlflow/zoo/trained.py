"""The zoo's trained section (family ``trained``): a small Llama-style decoder with real weights, for quantisation.

The other zoo models have random weights, on which a quantisation error says nothing about accuracy.  These are
trained by the build itself, offline and deterministically, on text every machine has: the running Python's own
standard library (``sysconfig.get_paths()["stdlib"]``: every ``.py`` file outside ``site-packages`` and the
``test``/``tests``/``idle_test`` folders), read as bytes (vocabulary 256, no tokenizer).  Files are sorted by relative
path and split by a hash of it (`rlflow.zoo.stdlib_text.is_heldout`: about 1 in 20 held out), so the split never
depends on file order.  The Python version and the split rule are in each file's metadata.

Entries, ``<key>[-outliers]-s128-<exporter>``:

* ``stdlib-llama`` (L4/H256, 8 heads, 4 KV heads, SwiGLU 688, untied head; a few minutes on 2 cores) and
  ``stdlib-llama-tiny`` (L2/H32, seconds; for tests);
* ``-outliers``: the same weights under a function-preserving rescale (`add_outliers`): on a few hidden channels (the
  same in every layer, drawn from the seed) every RMSNorm's scale is divided by s and the matching input columns of
  the projections it feeds (q/k/v, gate/up, the LM head) multiplied by s, so the projections have the outlier input
  channels that make large LLMs hard to quantise to int4 and a minutes-trained model lacks;
* ``-ts`` (TorchScript, opset 17) and ``-dynamo`` (opset 18): ``input_ids`` int64 (batch, sequence), both dynamic, to
  ``logits`` float32 (batch, sequence, 256); deployed shape (1, 128).

A build also writes ``<name>.heldout.npz`` beside the model: ``input_ids`` int64 (samples, 128), windows of the
held-out files, the arrays ``rlflow optimize --data`` takes; `heldout_loss` scores any model's logits on it.  One
training run serves every entry of a recipe: cached in the process and on disk (``$RLFLOW_CACHE/zoo/trained``), keyed
by the recipe, this module's source, the Python, torch and transformers versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import math
import os
import platform
import warnings
from pathlib import Path

from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.torch_threads import torch_threads
from rlflow.zoo.deploy import EXPORTERS
from rlflow.zoo.stdlib_text import SEQUENCE, SPLIT_RULE, corpora, heldout_loss, npz_bytes, windows

log = logging.getLogger("rlflow")

FAMILY = "trained"
OUTLIER_CHANNELS = 4
OUTLIER_SCALE = 30.0


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One model and how it is trained: AdamW, linear warmup then cosine decay to a tenth, gradients clipped at 1."""

    key: str
    config: dict  # LlamaConfig keyword arguments
    steps: int
    batch: int
    lr: float
    warmup: int
    threads: int  # torch's intra-op threads while training: results are bit-identical at a fixed count
    description: str
    tiny: bool = False
    seed: int = 0


_LLAMA = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0)
_TINY = dict(_LLAMA, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
RECIPES = (
    Recipe("stdlib-llama", _LLAMA, steps=600, batch=16, lr=2e-3, warmup=30, threads=2,
           description="Llama-style byte decoder trained on the Python stdlib (L4/H256, 8 heads, 4 KV heads)"),
    Recipe("stdlib-llama-tiny", _TINY, steps=20, batch=4, lr=3e-3, warmup=2, threads=1, tiny=True,
           description="Llama-style byte decoder trained on the Python stdlib (tiny: L2/H32, 20 steps)"),
)
_BY_KEY = {r.key: r for r in RECIPES}


def owns(entry) -> bool:
    return entry.family == FAMILY


def entries(entry_type) -> list:
    """The section's zoo entries (``entry_type`` is ``rlflow.zoo.ZooEntry``): by recipe, variant, exporter."""
    out = []
    for recipe in RECIPES:
        config = recipe.config
        hints = {"model_type": "gpt2", "num_heads": config["num_attention_heads"],
                 "hidden_size": config["hidden_size"], "num_kv_heads": config["num_key_value_heads"],
                 "head_dim": config["head_dim"]}  # onnxruntime's own Llama script optimizes as gpt2
        for outliers in (False, True):
            for exporter, (opset, _) in EXPORTERS.items():
                variant = "-outliers" if outliers else ""
                entry_config = dict(recipe=dataclasses.asdict(recipe), model="LlamaForCausalLM", exporter=exporter,
                                    opset=opset, tiny=recipe.tiny, outliers=outliers)
                if outliers:
                    entry_config.update(outlier_channels=OUTLIER_CHANNELS, outlier_scale=OUTLIER_SCALE)
                out.append(entry_type(
                    f"{recipe.key}{variant}-s{SEQUENCE}-{exporter}", FAMILY, {"input_ids": (1, SEQUENCE)}, None,
                    "transformers", entry_config, input_dtypes={"input_ids": "int64"},
                    input_ranges={"input_ids": (0, 256)}, output_names=("logits",),
                    description=f"{recipe.description}{', outlier channels' if outliers else ''}, {exporter} exporter",
                    transformer=hints))
    return out


def data_recipe() -> dict:
    """What the data depend on, for the definition hash: the Python whose stdlib is read, and the split rule."""
    return {"python": platform.python_version(), "split": SPLIT_RULE}


# -- training ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _training_settings():
    """Deterministic algorithms where torch has them, and denormals flushed to zero (they slow CPU steps several
    times over); afterwards the caller's determinism setting is put back and flushing turned off, torch's default."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        torch.set_flush_denormal(False)


def new_model(recipe: Recipe):
    """The untrained transformers model of `recipe`, its weights from `recipe.seed` (sdpa attention)."""
    import torch
    import transformers

    torch.manual_seed(recipe.seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**recipe.config, attn_implementation="sdpa"))


def mean_loss(model, ids, batch: int = 16) -> float:
    """`heldout_loss` of a torch model on int64 `ids`, in eval mode, `batch` rows at a time."""
    import torch

    model.eval()
    with torch.no_grad():
        losses = [heldout_loss(model(input_ids=torch.from_numpy(ids[i:i + batch])).logits.numpy(), ids[i:i + batch])
                  for i in range(0, len(ids), batch)]
    counts = [len(ids[i:i + batch]) for i in range(0, len(ids), batch)]
    return float(sum(loss * n for loss, n in zip(losses, counts)) / len(ids))


def train(recipe: Recipe, root=None) -> tuple[dict, dict]:
    """(state dict, statistics) of `recipe` trained from its seed on the training files: random windows of
    ``SEQUENCE + 1`` bytes; the statistics hold the final loss on 64 training and the held-out windows."""
    import time

    import numpy as np
    import torch

    train_data, heldout_data = corpora(root)
    start = time.perf_counter()
    with torch_threads(recipe.threads), _training_settings():
        model = new_model(recipe).train()
        rng = np.random.default_rng(recipe.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def rate(step: int) -> float:
            if step < recipe.warmup:
                return (step + 1) / recipe.warmup
            done = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
        offsets, curve, recent = np.arange(SEQUENCE + 1), [], []
        for step in range(recipe.steps):
            starts = rng.integers(0, len(train_data) - SEQUENCE - 1, recipe.batch)
            batch = torch.from_numpy(train_data[starts[:, None] + offsets].astype(np.int64))
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            recent.append(loss.item())
            if (step + 1) % max(1, recipe.steps // 8) == 0 or step + 1 == recipe.steps:
                curve.append([step + 1, round(sum(recent) / len(recent), 4)])
                log.info("%s: step %d/%d, training loss %.3f (%.0f s)", recipe.key, step + 1, recipe.steps,
                         curve[-1][1], time.perf_counter() - start)
                recent = []
        seconds = time.perf_counter() - start
        stats = dict(train_loss=mean_loss(model, windows(train_data)),
                     heldout_loss=mean_loss(model, windows(heldout_data)), train_seconds=round(seconds, 1),
                     train_curve=curve, tokens_seen=recipe.steps * recipe.batch * SEQUENCE,
                     train_bytes=int(len(train_data)), heldout_bytes=int(len(heldout_data)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


def _cache_path(recipe: Recipe) -> Path:
    import torch
    import transformers

    from rlflow.files import cache_dir

    key = json.dumps([dataclasses.asdict(recipe), data_recipe(), torch.__version__, transformers.__version__,
                      hashlib.sha256(Path(__file__).read_bytes()).hexdigest()], sort_keys=True)
    return cache_dir("zoo") / "trained" / f"{recipe.key}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


@functools.lru_cache(maxsize=2)
def trained(key: str) -> tuple[dict, dict]:
    """`train`'s result for the recipe `key`, made once per process and kept on disk for the next one."""
    import torch

    recipe, path = _BY_KEY[key], _cache_path(_BY_KEY[key])
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return saved["state"], json.loads(saved["stats"])
    state, stats = train(recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"state": state, "stats": json.dumps(stats)}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for stale in path.parent.glob(f"{recipe.key}-" + "?" * 16 + ".pt"):  # earlier sources' runs
        if stale != path:
            stale.unlink(missing_ok=True)
    return state, stats


# -- outliers and export -----------------------------------------------------------------------------------------------

def outlier_channels(hidden: int, count: int = OUTLIER_CHANNELS, seed: int = 0) -> list[int]:
    """The hidden channels made outliers: the same in every layer, as large LLMs' are."""
    import numpy as np

    return sorted(int(c) for c in np.random.default_rng(seed).choice(hidden, count, replace=False))


def add_outliers(model, channels: list[int], scale: float = OUTLIER_SCALE) -> None:
    """Divides each RMSNorm's scale on `channels` by `scale` and multiplies the matching input columns of every
    projection it feeds by `scale`: the same function, outlier input channels in q/k/v, gate/up and the LM head."""
    import torch

    pairs = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        pairs += [(layer.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj]),
                  (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])]
    pairs.append((model.model.norm, [model.lm_head]))
    index = torch.tensor(channels)
    with torch.no_grad():
        for norm, projections in pairs:
            norm.weight[index] /= scale
            for projection in projections:
                projection.weight[:, index] *= scale


def wrap(model):
    """The module the exporters see: ``input_ids`` in, ``logits`` out (no cache).  It passes an all-ones
    ``attention_mask``: without one transformers traces a packed-sequence check (``aten::diff``, which TorchScript
    cannot export)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            mask = torch.ones_like(input_ids)
            return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    return Logits().eval()


def model_of(entry):
    """(eval-mode model of `entry`, training statistics, outlier channels or None)."""
    config = entry.config
    recipe = _BY_KEY[config["recipe"]["key"]]
    state, stats = trained(recipe.key)
    model = new_model(recipe)
    model.load_state_dict(state)
    channels = None
    if config["outliers"]:
        channels = outlier_channels(recipe.config["hidden_size"], config["outlier_channels"], recipe.seed)
        add_outliers(model, channels, config["outlier_scale"])
    return model.eval(), stats, channels


def export_model(wrapper, exporter: str) -> bytes:
    """ONNX bytes of the wrapped model by `exporter`, traced at batch 2 and sequence 8 with both axes dynamic."""
    import torch

    opset = EXPORTERS[exporter][0]
    example = (torch.arange(16, dtype=torch.int64).reshape(2, 8) * 7 % 256,)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            buffer = io.BytesIO()
            torch.onnx.export(wrapper, example, buffer, dynamo=False, opset_version=opset, input_names=["input_ids"],
                              output_names=["logits"], do_constant_folding=True,
                              dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                            "logits": {0: "batch", 1: "sequence"}})
            data = buffer.getvalue()
        else:
            from torch.export import Dim

            limit = wrapper.model.config.max_position_embeddings
            shapes = ({0: Dim("batch"), 1: Dim("sequence", min=1, max=limit)},)
            program = torch.onnx.export(wrapper, example, dynamo=True, opset_version=opset,
                                        input_names=["input_ids"], output_names=["logits"], dynamic_shapes=shapes,
                                        verbose=False)
            data = program.model_proto.SerializeToString()
    wrapper.eval()
    return data


def export(entry):
    """The zoo's ``Export`` of a trained entry, with its held-out ``.npz`` as a sidecar file.

    Raises:
        RlflowError: transformers is not installed.
        RuntimeError: the outlier rescale changed the model's function.
    """
    try:
        import transformers
    except ImportError:
        from rlflow.errors import RlflowError

        raise RlflowError(f"zoo model '{entry.name}' needs transformers: pip install 'rlflow[deploy]'") from None
    import numpy as np
    import onnx
    import torch

    from rlflow.zoo import base as zoo

    exporter = entry.config["exporter"]
    heldout = windows(corpora()[1])
    model, stats, channels = model_of(entry)
    wrapper = wrap(model)
    feeds = {"input_ids": heldout[:1]}
    with torch_threads(1), torch.no_grad():
        expected = wrapper(torch.from_numpy(feeds["input_ids"])).numpy()
        extra = {}
        if channels is not None:  # the rescale must leave the function as it was
            plain = dataclasses.replace(entry, config=dict(entry.config, outliers=False))
            reference = wrap(model_of(plain)[0])(torch.from_numpy(heldout[:4])).numpy()
            diff = float(np.abs(wrapper(torch.from_numpy(heldout[:4])).numpy() - reference).max()
                         / np.abs(reference).max())
            if diff > 1e-4:
                raise RuntimeError(f"zoo model '{entry.name}': the outlier rescale changed the logits by {diff:.2e}")
            extra = dict(outlier_channels=channels, outlier_scale=entry.config["outlier_scale"],
                         outlier_max_rel_diff=diff)
        exported_loss = mean_loss(model, heldout)
    data = export_model(wrapper, exporter)
    props = {DEPLOYED_SHAPES_KEY: format_input_shapes(entry.input_shapes), "rlflow.zoo.exporter": exporter,
             "rlflow.zoo.python": platform.python_version(), "rlflow.zoo.data_split": SPLIT_RULE,
             "rlflow.zoo.train_loss": f"{stats['train_loss']:.4f}",
             "rlflow.zoo.heldout_loss": f"{stats['heldout_loss']:.4f}"}
    if channels is not None:
        props["rlflow.zoo.outlier_channels"] = ",".join(map(str, channels))
    return zoo.Export(
        proto=onnx.load_from_string(data), feeds=feeds, expected=[expected], exporter=EXPORTERS[exporter][1],
        opset=EXPORTERS[exporter][0], props=props,
        metadata=dict(transformers=transformers.__version__, transformer=entry.transformer,
                      python=platform.python_version(), data_split=SPLIT_RULE,
                      heldout_file=f"{entry.name}.heldout.npz", heldout_samples=len(heldout),
                      heldout_loss_torch=exported_loss, training=stats, **extra),
        sidecars={".heldout.npz": npz_bytes({"input_ids": heldout})})
