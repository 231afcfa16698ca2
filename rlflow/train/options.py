"""Command-line options from a trainer's config dataclass, so every field is settable and documented once."""
from __future__ import annotations

import argparse
import dataclasses
import typing


def config_from_args(config_cls, argv: typing.Sequence[str] | None, prog: str, description: str):
    """A `config_cls` instance from `--kebab-case` options (tuples comma-separated, booleans as --flag / --no-flag,
    `typing.Literal` fields as a choice among their values, a field with a `const` in its metadata as an option whose
    value may be left out)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    defaults = config_cls()
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if "const" in f.metadata:  # `--flag` alone means the const, `--flag VALUE` the value
            parser.add_argument(flag, nargs="?", const=f.metadata["const"], default=default,
                                help=f"default: {default}; alone: {f.metadata['const']}")
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), default=default, help=f"default: {default}")
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, default=",".join(default), help=f"comma-separated (default: {','.join(default)})")
        else:
            args = typing.get_args(kind)
            base = next((a for a in args if a is not type(None)), kind) if args else kind
            parser.add_argument(flag, type=base, default=default, help=f"default: {default}")
    ns = parser.parse_args(argv)
    values = {}
    for f in dataclasses.fields(config_cls):
        value = getattr(ns, f.name)
        if typing.get_origin(hints[f.name]) is tuple and isinstance(value, str):
            value = tuple(v for v in value.split(",") if v)
        values[f.name] = value
    return config_cls(**values)
