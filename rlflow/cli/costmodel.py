"""`rlflow costmodel`: the cost model's table checked against measurement, its entries audited, the GPU estimate fitted
to a table measured on the device."""
from __future__ import annotations

import click

from rlflow.measure.costmodel.audit import FACTOR, FLOOR_MS


@click.group()
def costmodel() -> None:
    """The cost model's table: check it against measurement, audit its entries, fit the GPU estimate."""


@costmodel.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--out", default="docs/results/costmodel.json", show_default=True,
              help="JSON report (merged by model; a markdown page beside it).")
@click.option("--sequences", type=int, default=12, show_default=True, help="Random rewrite sequences per model.")
@click.option("--length", type=int, default=6, show_default=True, help="Longest sequence.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--rounds", type=int, default=20, show_default=True, help="Interleaved rounds per comparison.")
@click.option("--repeats", type=int, default=2, show_default=True,
              help="Independent measurement repeats; with 2 or more the report gives their rank agreement (retest "
                   "Spearman), the ceiling any estimate can reach.")
@click.option("--everywhere", is_flag=True,
              help="Each step applies a random rule wherever it matches (graphs a measurement separates).")
@click.option("--rules", default=None,
              help="Draw the rewrites from a rule group (such as fusion) or comma-separated rule names only "
                   "[default: all].")
@click.option("--provider", default="cpu", show_default=True, help="auto, cpu or cuda.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--cache-dir", default=None, help="Cost table folder [default: $RLFLOW_CACHE/costmodel].")
def check(models, out, sequences, length, seed, rounds, repeats, everywhere, rules, provider, threads,
          cache_dir) -> None:
    """Rank correlation of the cost model's estimates with interleaved end-to-end measurements.

    MODELS are ONNX files or zoo names.  Over random rewrite sequences of each, the Spearman rank correlation of the
    estimates with the measurements, beside the measurement's own retest agreement."""
    from rlflow.measure.costmodel.check import check_models

    check_models(models, out, sequences, length, seed, rounds, repeats, everywhere, rules, provider, threads,
                 cache_dir)


@costmodel.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--sequences", type=int, default=20, show_default=True, help="Random rewrite sequences per model.")
@click.option("--length", type=int, default=10, show_default=True, help="Longest sequence.")
@click.option("--everywhere", is_flag=True,
              help="Each step applies a random rule wherever it matches (as `rlflow costmodel check --everywhere`).")
@click.option("--repeats", type=int, default=3, show_default=True, help="New measurements per table entry.")
@click.option("--refresh", is_flag=True,
              help="Write each audited entry's new median into the table (on an idle machine only).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--factor", type=float, default=FACTOR, show_default=True, help="Disagreement factor.")
@click.option("--floor-ms", type=float, default=FLOOR_MS, show_default=True,
              help="Smallest difference that counts (ms).")
@click.option("--cache-dir", default=None, help="Cost table folder [default: $RLFLOW_CACHE/costmodel].")
@click.option("--out", default=None, help="JSON report (and a markdown page beside it).")
def audit(models, sequences, length, everywhere, repeats, refresh, seed, factor, floor_ms, cache_dir, out) -> None:
    """Measure a model's fusion groups again and list the cached costs the new measurements do not confirm.

    MODELS are ONNX files or zoo names.  With --refresh, the new medians take the cached costs' place."""
    from rlflow.cli.common import invocation
    from rlflow.measure.costmodel.audit import audit_models

    audit_models(models, sequences, length, everywhere, repeats, refresh, seed, factor, floor_ms, cache_dir, out,
                 command=invocation())


@costmodel.command()
@click.option("--table", required=True, help="A cost table measured on the device.")
@click.option("--models", "models", multiple=True, metavar="NAME...",
              help="Zoo names or .onnx files (several after one --models, or --models repeated) [default: every "
                   "full-size zoo model].")
@click.option("--sequences", type=int, default=8, show_default=True, help="Random rewrite sequences per model.")
@click.option("--length", type=int, default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", required=True, help="JSON: the estimate fitted on every entry, and the report.")
@click.option("--report", default=None, help="Markdown report.")
@click.argument("more_models", nargs=-1, metavar="")
def fit(table, models, sequences, length, seed, out, report, more_models) -> None:
    """Fit the estimate of a GPU's group costs to a table measured on it, and report its held-out error.

    The cost model of a GPU this machine does not have: the estimate's coefficients are fitted to the table's
    entries, and its error is reported on architectures kept out of one fit."""
    from rlflow.measure.costmodel.gpu_estimate import fit_to_table

    if more_models and not models:  # `--models a b c` takes every name up to the next option, as it always did
        raise click.UsageError(f"Got unexpected extra arguments ({' '.join(more_models)})")
    fit_to_table(table, out, [*models, *more_models] or None, sequences, length, seed, report)
