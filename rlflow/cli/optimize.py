"""`rlflow optimize` and `rlflow rules`: the library's front door, and the rules it offers."""
from __future__ import annotations

import json
from pathlib import Path

import click

from rlflow.errors import RlflowError


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "--out", "output", type=click.Path(path_type=Path),
              help="Output file [default: MODEL.rlflow.onnx] (--out as `rlflow bench` and `rlflow zoo build` spell it).")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Execution provider to optimise for.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="onnxruntime intra-op threads for every measurement.")
@click.option("--method", type=click.Choice(["agent", "greedy", "taso", "random"]), default=None,
              help="Search method: the trained agent's rollouts, measured greedy, TASO-style cost-model "
              "backtracking, or random walks [default: agent where the agent was trained for the provider and "
              "knows every rule that matches the model, else greedy].")
@click.option("--agent", "agent", type=click.Path(path_type=Path), default=None,
              help="Policy checkpoint for --method agent [default: the shipped agent].")
@click.option("--finetune", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Adapt the agent to MODEL first with N PPO steps: in its world model's dream (the shipped agent) "
                   "or against the cost model (a PPO policy); no measurements; with --time-limit they may use half "
                   "of it.")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None,
              help="Seconds for the search (verification and the final measurement come on top) "
                   "[default: 10 for agent, 60 for the searches].")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,...",
              help="Fix a dynamic input's dimensions for measurement (repeatable); the output keeps them dynamic.")
@click.option("--fix-dim", "fixed_dims", multiple=True, metavar="NAME=VALUE",
              help="Fix a symbolic input dimension in the output (repeatable), as onnxruntime's "
                   "make_dynamic_shape_fixed does: it then runs at that value only, and rewrites may rely on it "
                   "(batch=1 lets a decoder's attention take its rotary embedding in).")
@click.option("--fix-value", "fixed_values", multiple=True, metavar="NAME=VALUE",
              help="Declare every element of an input to be VALUE (repeatable): the output reads a constant of its "
                   "shape instead, so rewrites may rely on it (attention_mask=1 where nothing is ever padded lets a "
                   "decoder's attention mask itself).")
@click.option("--profile", "profile_specs", multiple=True, metavar="NAME=D0,D1;...[@WEIGHT]",
              help="A shape the model will run at, for every dynamic input, with its share of the traffic "
                   "(repeatable): the output is kept only if faster on the weighted mean and slower at no profile "
                   "[default for a text model with no shapes given: batch 1 at sequence 16 and 128].")
@click.option("--profiles", "profiles_file", type=click.Path(path_type=Path), default=None,
              help="A file of profiles, one per line in the --profile syntax.")
@click.option("--ops", type=click.Choice(["all", "standard"]), default="all", show_default=True,
              help="Operators the output may use: all (onnxruntime's contrib fusions too) or standard (default ONNX "
                   "domain only, for models that must also run on other runtimes).")
@click.option("--cuda-graph", is_flag=True,
              help="CUDA only: measure every model as onnxruntime's captured CUDA graph (enable_cuda_graph, inputs "
                   "and outputs bound on the device), the way to run the output; needs fixed shapes and every node "
                   "on CUDA.")
@click.option("--precision", type=str, default=None, metavar="int4|int8|fp16|bf16",
              help="After the exact rewrites, lower precision where it pays, within --max-error: int4 or int8 (the "
                   "weights of the layers chosen in fewer bits), fp16 or bf16 (the nodes chosen computed in half, "
                   "bf16 on CUDA only) [default: exact].")
@click.option("--max-error", type=float, default=None, metavar="X",
              help="With --precision: the relative error norm ||out - ref|| / ||ref|| each output may reach against "
                   "MODEL [default: 0.10 for int4, 0.02 for int8, 0.01 for fp16, 0.05 for bf16].")
@click.option("--data", type=click.Path(path_type=Path), default=None, metavar="FILE.npz",
              help="With --precision: arrays named after MODEL's inputs, first axis = samples, to measure the error "
                   "on [default: random inputs, which the report says].")
@click.option("--padding", "padding_spec", default=None, metavar="NAME=right",
              help="Declare that the 2-D mask NAME of a KV-cache decoder step is right-padded (each row ones then "
                   "zeros, its cache valid in its first positions): attentions then read each row's length instead "
                   "of a bias computed from the mask, as onnxruntime-genai's graph does; valid under the contract "
                   "only, and verified on padded batches (docs/padding.md).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the report as JSON.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random inputs and measurement order.")
@click.option("--quiet", is_flag=True, help="Print only the output path.")
def optimize(model, output, provider, threads, method, agent, finetune, time_limit, input_shapes, fixed_dims,
             fixed_values, profile_specs, profiles_file, ops, cuda_graph, precision, max_error, data, padding_spec,
             json_path, seed, quiet) -> None:
    """Optimise MODEL and write the verified result."""
    from rlflow.files import write_text_atomic
    from rlflow.graph.input_shapes import parse_fixed_dims, parse_input_shapes
    from rlflow.graph.input_values import parse_fixed_values
    from rlflow.measure.shape_profiles import given_profiles
    from rlflow.optimize.padding import parse_padding
    from rlflow.optimize.pipeline import optimize as run
    from rlflow.optimize.report import format_report

    output = output or model.with_name(model.name[: -len(".onnx")] + ".rlflow.onnx" if model.name.endswith(".onnx")
                                       else model.name + ".rlflow.onnx")
    if output.resolve() == model.resolve():
        raise RlflowError("the output path is the input path; rlflow never overwrites its input")
    result = run(model, provider=provider, threads=threads, method=method, time_limit=time_limit,
                 input_shapes=parse_input_shapes(input_shapes), fix_dims=parse_fixed_dims(fixed_dims),
                 fix_values=parse_fixed_values(fixed_values), seed=seed,
                 progress=not quiet, agent=agent,
                 finetune=finetune, ops=ops, profiles=given_profiles(profile_specs, profiles_file),
                 cuda_graph=cuda_graph, precision=precision, max_error=max_error, data=data,
                 padding=parse_padding(padding_spec))
    result.save(output)
    if json_path:
        report = {**result.as_dict(), "output": str(output)}
        write_text_atomic(json_path, json.dumps(report, indent=2, default=str) + "\n")
    click.echo(str(output) if quiet else format_report(result) + f"\n  written     {output}")


@click.command()
@click.option("--model", type=click.Path(path_type=Path), help="Count matches of every rule in this model.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,...")
def rules(model, input_shapes) -> None:
    """List the rewrite rules (with --model: how often each matches)."""
    from rlflow.graph.core import load
    from rlflow.graph.input_shapes import parse_input_shapes
    from rlflow.rewrites import RULES, match_counts

    counts = match_counts(load(model, parse_input_shapes(input_shapes))) if model else None
    width = max(len(r.name) for r in RULES)
    for index, rule in enumerate(RULES):
        count = "" if counts is None else f"{counts.get(rule.name, 0):>6}  "
        contrib = " [contrib]" if rule.contrib else ""
        click.echo(f"{index:>3}  {rule.name:<{width}}  {rule.group:<8}  {count}{rule.description}{contrib}")
    if counts is not None:
        click.echo(f"{sum(counts.values())} matches of {sum(c > 0 for c in counts.values())} rules in {model}")
