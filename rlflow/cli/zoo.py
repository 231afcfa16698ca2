"""`rlflow zoo`: the model zoo's list and builds, and the models over protobuf's 2 GB limit."""
from __future__ import annotations

import logging
from pathlib import Path

import click


@click.group()
def zoo() -> None:
    """The model zoo: real architectures defined in PyTorch, exported to ONNX offline; its deployment section
    (family deploy) exports Hugging Face transformers models as users do."""


_ZOO_FAMILIES = click.Choice(["cnn", "transformer", "rnn", "deploy", "trained"])


@zoo.command("list")
@click.option("--tiny/--no-tiny", default=False, show_default=True, help="Include the small test variants.")
@click.option("--family", type=_ZOO_FAMILIES, default=None,
              help="Only this family [default: every family; the deployment section last].")
def zoo_list(tiny, family) -> None:
    """Name, parameters, FLOPs, node count and input shapes of every zoo model.

    Models not built yet are built into the cache first, except the deployment section's (family deploy), whose
    figures show once `rlflow zoo build --family deploy` has built them.
    """
    from rlflow import zoo as registry

    listed = registry.names(include_tiny=tiny, family=family)
    if family is None:
        listed += registry.names(include_tiny=tiny, family=registry.DEPLOY)
    width = max([32, *(len(name) + 2 for name in listed)])  # the decoders' names run past 30 characters
    click.echo(f"{'name':<{width}}{'family':<13}{'params':>12}{'GFLOPs':>10}{'nodes':>7}  inputs")
    for name in listed:
        row = registry.summary(name, build_missing=registry.get(name).family != registry.DEPLOY)
        items = [f"{k}:{list(v)}" for k, v in row["input_shapes"].items()]
        shapes = ", ".join(items[:3] + ([f"... ({len(items) - 3} more)"] if len(items) > 3 else []))
        if row["params"] is None:
            figures = f"{'-':>12}{'-':>10}{'-':>7}"
        else:
            figures = f"{row['params']:>12,}{row['flops'] / 1e9:>10.3f}{row['nodes']:>7}"
        click.echo(f"{name:<{width}}{row['family']:<13}{figures}  {shapes}")


@zoo.command("build")
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path), default=Path("models"), show_default=True)
@click.option("--force", is_flag=True, help="Rebuild even when the definition is unchanged.")
@click.option("--tiny/--no-tiny", default=False, show_default=True, help="With no NAMES: also build tiny variants.")
@click.option("--family", type=_ZOO_FAMILIES, default=None,
              help="With no NAMES: this family only; 'deploy' builds the deployment section (needs the deploy extra).")
def zoo_build(names, out, force, tiny, family) -> None:
    """Build zoo models into --out: NAMES, else every full-size model but the deployment section's.

    A model that fails to build is reported and the others are still built (exit 1 at the end): on the GPU machine
    one export that failed under another transformers version used to leave every model after it unbuilt."""
    from rlflow import zoo as registry

    wanted = list(names or registry.names(include_tiny=tiny, family=family))
    failed = []
    for name in wanted:
        try:
            result = registry.build(name, out, force=force)
        except Exception as exc:  # noqa: BLE001 - one line per model; --debug raises it with its traceback
            if len(wanted) == 1 or logging.getLogger("rlflow").isEnabledFor(logging.DEBUG):
                raise
            click.echo(f"error: {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}", err=True)
            failed.append(name)
            continue
        state = "unchanged" if result.skipped else f"built in {result.seconds:.1f} s"
        click.echo(f"{result.path}  {state}  ({result.nodes} nodes, {result.params:,} params)")
    if failed:
        click.echo(f"error: {len(failed)} of {len(wanted)} models not built: {', '.join(failed)}", err=True)
        raise click.exceptions.Exit(1)


@zoo.command("build-large")
@click.argument("case", type=click.Choice(["dense", "gpt2-large"]))
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Folder to write the model and its data into.")
def zoo_build_large(case, out) -> None:
    """Build a model over protobuf's 2 GB limit (its weights in an external-data file).

    dense: ten dense 8192x8192 MatMul layers (2.5 GiB); gpt2-large: GPT-2 large's decode step (3.1 GB of float32
    weights, random; needs the deploy extra).  Built by a command rather than committed."""
    from rlflow.zoo.large_models import build_large

    click.echo(str(build_large(case, out)))
