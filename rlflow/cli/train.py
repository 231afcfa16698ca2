"""The agents' commands: `rlflow train` (every field of the trainer's config an option), `evaluate` and `ship`."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import click


def config_options(config_cls) -> list[click.Option]:
    """One `--kebab-case` option per field of the dataclass `config_cls`, so that every field is settable and
    documented once: tuples comma-separated, booleans as --flag / --no-flag, `typing.Literal` fields as a choice
    among their values, a field with a `const` in its metadata as an option whose value may be left out (`--ray`
    alone), every other field of its type (the one beside None where it may be None); each says its default."""
    defaults = config_cls()
    hints = typing.get_type_hints(config_cls)
    options = []
    for f in dataclasses.fields(config_cls):
        kind, default = hints[f.name], getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if "const" in f.metadata:  # `--flag` alone means the const, `--flag VALUE` the value
            option = click.Option([f.name, flag], is_flag=False, flag_value=f.metadata["const"], default=default,
                                  help=f"default: {default}; alone: {f.metadata['const']}")
        elif kind is bool:
            option = click.Option([f.name, f"{flag}/--no-{flag[2:]}"], default=default, help=f"default: {default}")
        elif typing.get_origin(kind) is typing.Literal:
            option = click.Option([f.name, flag], type=click.Choice(typing.get_args(kind)), default=default,
                                  help=f"default: {default}")
        elif typing.get_origin(kind) is tuple:
            option = click.Option([f.name, flag], default=",".join(default),
                                  help=f"comma-separated (default: {','.join(default)})")
        else:
            args = typing.get_args(kind)
            base = next((a for a in args if a is not type(None)), kind) if args else kind
            option = click.Option([f.name, flag], type=base, default=default, help=f"default: {default}")
        options.append(option)
    return options


def config_command(config_cls, prog: str, description: str) -> click.Command:
    """A command whose options are `config_options(config_cls)` and whose result is the `config_cls` they make."""
    hints = typing.get_type_hints(config_cls)

    def make(**values):
        for name, value in values.items():
            if typing.get_origin(hints[name]) is tuple and isinstance(value, str):
                values[name] = tuple(v for v in value.split(",") if v)
        return config_cls(**values)

    return click.Command(prog, params=config_options(config_cls), callback=make, help=description,
                         context_settings={"help_option_names": ["-h", "--help"]})


def parse_config(config_cls, args: typing.Sequence[str], prog: str = "rlflow train", description: str | None = None):
    """A `config_cls` instance from the options `args`, as `rlflow train` reads them.

    Raises:
        click.UsageError: an unknown option or an invalid value.
        click.exceptions.Exit: `--help` (the help is printed).
    """
    command = config_command(config_cls, prog, description)
    with command.make_context(prog, list(args)) as ctx:
        return command.invoke(ctx)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.option("--algo", type=click.Choice(["ppo", "worldmodel"]), required=True,
              help="ppo: model-free masked PPO; worldmodel: VAE + MDN-RNN with a controller trained in the dream.")
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def train(algo, options) -> None:
    """Train an agent; every option of the trainer's Config is accepted (`rlflow train --algo ppo --help`)."""
    if algo == "ppo":
        from rlflow.train import ppo as trainer
        from rlflow.train.ppo import Config
    else:
        from rlflow.train.worldmodel import loop as trainer
        from rlflow.train.worldmodel.config import Config
    config = parse_config(Config, options, f"rlflow train --algo {algo}", trainer.__doc__.split("\n")[0])
    trainer.main(config)


@click.command()
@click.option("--checkpoint", required=True, help="The policy (ppo.pt).")
@click.option("--results", required=True, help="The training run's ppo.json.")
@click.option("--out", default="docs/results", show_default=True, help="Folder of the evaluated ppo.json and its plot.")
def evaluate(checkpoint, results, out) -> None:
    """A trained policy against the random-walk baseline, measured end to end.

    The acceptance check of the agent, added to a training run's results (`rlflow train --algo ppo --no-evaluate`
    leaves it out)."""
    from rlflow.cli.common import invocation
    from rlflow.train.evaluate import evaluate_checkpoint

    evaluate_checkpoint(checkpoint, results, out, command=invocation())


@click.command()
@click.option("--checkpoint", required=True, help="The training run's ppo.pt or worldmodel.pt.")
@click.option("--results", required=True, help="The training run's ppo.json or worldmodel.json.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder of the shipped agent [default: rlflow/checkpoints, the package's].")
@click.option("--name", default=None, help="File stem [default: 'default' for a world-model agent, the one rlflow "
                                           "optimize uses; 'ppo' for a PPO policy].")
def ship(checkpoint, results, out, name) -> None:
    """Turn a training run's checkpoint into a shipped agent.

    Writes `<out>/<name>.pt` and `<name>.json` (what it was trained on, for which provider, which architectures it
    never saw, under which rule registry, and the command that reproduces it)."""
    from rlflow.train.ship import AGENTS_DIR, ship_checkpoint

    out = out or AGENTS_DIR
    meta = ship_checkpoint(checkpoint, results, out, name)
    held = meta["held_out"]  # every zoo model not trained on: over a hundred names, listed in the JSON beside it
    click.echo(f"shipped {out / meta['checkpoint']} ({meta['bytes'] / 1e6:.2f} MB, registry "
               f"{meta['registry_version']}, trained on {len(meta['trained_on'])} models, {len(held)} zoo models held "
               f"out: {out / Path(meta['checkpoint']).with_suffix('.json').name})")
