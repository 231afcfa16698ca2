"""What `rlflow optimize` can be asked: the search methods, operator sets and default time limits, and `Options`,
one field per setting, each checked once before any work starts."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from rlflow.errors import InputError
from rlflow.measure.session import PROVIDERS
from rlflow.measure.shape_profiles import Profile
from rlflow.rewrites import RULES, Rule

if TYPE_CHECKING:
    from rlflow.graph.core import Graph

METHODS = ("agent", "greedy", "taso", "random")
"""agent: the shipped policy's rollouts, best few measured; greedy: the best measured rewrite (all fusions, a rule
everywhere, a rule at one kind of location), repeated; taso: cost-model backtracking search (TASO); random: random
walks."""

OPS = ("all", "standard")
"""Operator sets an output may use: `all` (onnxruntime's contrib operators too: the fusions) or `standard` (the default
ONNX domain only, for models that must also run outside onnxruntime: rules that emit contrib operators are left out)."""

DEFAULT_TIME_LIMITS = {"agent": 10.0, "greedy": 60.0, "taso": 60.0, "random": 60.0}
"""Seconds of search when none is given: the agent's point is to be quick, the searches' to be thorough."""


@dataclass(frozen=True)
class Options:
    """What to optimise for and how; every field is an `rlflow optimize` option of the same name."""

    provider: str = "auto"
    """`auto` (CUDA when usable, else CPU), `cpu` or `cuda`."""
    threads: int = 1
    """onnxruntime intra-op threads of every measurement (1 is the quiet setting on small machines)."""
    method: str | None = None
    """Search method (`METHODS`); None: `default_method` for the provider."""
    time_limit: float | None = None
    """Seconds of search (None: `DEFAULT_TIME_LIMITS`); the final verification and measurement come on top."""
    input_shapes: Mapping[str, Sequence[int]] | None = None
    """Values for dynamic input dimensions while measuring; the written model keeps them dynamic."""
    fix_dims: Mapping[str, int] | None = None
    """Symbolic input dimensions the written model fixes (`batch=1`): it then runs at those values only, and rules may
    rely on them (`rlflow.graph.input_shapes.fix_dims`); the input, so fixed, is what the output is verified and
    measured against."""
    fix_values: Mapping[str, float] | None = None
    """Inputs whose every element is one value (`attention_mask=1`: nothing is ever padded): the written model reads
    a constant of the input's shape instead (`rlflow.graph.input_values.fix_values`), so rules may rely on it; the
    input, so fixed, is what the output is verified and measured against."""
    seed: int = 0
    """Random inputs and measurement order."""
    rounds: int = 30
    """Most interleaved rounds of the final input-vs-output measurement (fewer on a large model:
    `rlflow.measure.gate`)."""
    rules: Sequence[Rule] = RULES
    """The rules the search may use."""
    progress: bool = False
    """Progress bars on the terminal."""
    agent: str | os.PathLike | None = None
    """The checkpoint of method `agent` (None: the shipped one)."""
    finetune: int = 0
    """Method `agent` only: PPO steps adapting the agent to this model first (`rlflow.train.finetune`: a PPO policy
    against the cost model, a world-model agent in its dream); with a `time_limit`, they may use half of it."""
    ops: str = "all"
    """The operators the output may use (`OPS`); `standard` keeps only rules whose output stays in the default ONNX
    domain (rule ids are the registry's, so the agents need no retraining).  On CUDA, rules whose output has no CUDA
    kernel are left out too (`rules_for`)."""
    profiles: Sequence[Profile] | None = None
    """Shapes the model will run at, with their shares of the traffic (`rlflow.measure.shape_profiles`), instead of
    `input_shapes`: candidates are scored by their weighted geometric mean speedup, and the output is kept only when
    that is measurably above 1 and no profile is measurably slower.  Without either, and without shapes in the
    model's metadata, a text model gets `default_profiles`."""
    cuda_graph: bool = False
    """CUDA only: every measurement runs the models as onnxruntime's captured CUDA graphs
    (`SessionSettings.cuda_graph`), the configuration to deploy the output in."""
    precision: str | None = None
    """`int4` or `int8` (`rlflow.optimize.precision.PRECISIONS`): after the exact search, layers stored in fewer bits
    where the output stays within `max_error` (None: exact, the default)."""
    max_error: float | None = None
    """With `precision`: the relative error norm each output may reach against the input (None: the precision's
    default, `DEFAULT_MAX_ERROR`)."""
    padding: Mapping[str, str] | None = None
    """A contract on the model's inputs (`{"attention_mask": "right"}`: every row's mask is ones then zeros, its
    cache valid in its first positions): attentions then read each row's length instead of a bias computed from the
    mask (`rlflow.optimize.padding`, docs/padding.md), which is valid under the contract only, and verified so."""
    data: str | os.PathLike | None = None
    """With `precision`: an .npz of arrays named after the model's inputs, first axis = samples, to measure the error
    on (None: random inputs, and the report says so)."""

    def check(self) -> None:
        """Raises InputError, naming the option, for a value no run could use."""
        if self.method is not None and self.method not in METHODS:
            raise InputError(f"unknown method '{self.method}': choose from {', '.join(METHODS)}")
        if self.finetune < 0 or (self.finetune and self.method not in (None, "agent")):
            raise InputError("--finetune takes a number of steps >= 0 and adapts method 'agent' only")
        if self.ops not in OPS:
            raise InputError(f"unknown operator set '{self.ops}': choose from {', '.join(OPS)}")
        from rlflow.optimize.precision import check_precision

        check_precision(self.precision, self.max_error, self.data, self.ops)
        from rlflow.optimize.padding import check_padding

        check_padding(self.padding, self.precision)


def default_method(provider: str, agent: str | os.PathLike | None = None, graph: Graph | None = None,
                   rules: Sequence[Rule] = RULES) -> tuple[str, str | None]:
    """The search `rlflow optimize` runs when none is named, with the reason where it is not the agent: the agent
    where it was trained for `provider` (an onnxruntime provider name) and knows every rule of `rules` that matches
    `graph`, else greedy search.  An agent acts on what it learnt of one provider's costs, so on another provider
    greedy search, which measures, is the safer default; and an agent trained before a rule was added never plays
    it, nor one that was in its registry but never matched in its training (the CPU agent, trained on encoders, trails
    greedy on decoders).  A fold rule it never learnt does not count: those remove work a shape or a constant already
    decides (`shape-dim-fold` matches most exports), and leaving them is what the agent did before they existed.
    """
    from rlflow.search.agent import agent_rules, offered_rules, shipped_agent, trained_provider

    path = agent if agent is not None else shipped_agent(provider)
    which = "the given agent" if agent is not None else "the shipped agent"
    trained = trained_provider(path)
    if PROVIDERS.get(trained) != provider:
        return "greedy", f"{which} is trained for {trained}, not {provider}; --method agent runs it anyway"
    if graph is not None:
        known = set(agent_rules(path))
        offered = offered_rules(path)
        if offered is not None:  # a rule in its registry that never matched in training was never played either
            known &= set(offered)
        unknown = [r.name for r in rules if r.name not in known and r.group != "fold" and r.find(graph)]
        if unknown:
            named = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
            verb = "matches" if len(unknown) == 1 else "match"
            return "greedy", f"{which} never learnt {named}, which {verb} this model; --method agent runs it anyway"
    return "agent", None


def rules_for(rules: Sequence[Rule], ops: str, provider: str) -> list[Rule]:
    """The rules a search may use for an output of operator set `ops` on `provider`: `standard` leaves out every rule
    that emits contrib operators, and CUDA those that emit an operator with no CUDA kernel (`Rule.cuda`), which would
    run on the CPU between copies and make onnxruntime refuse CUDA graph capture (BERT-L4's pooler as FusedGemm cost
    the search every all-fusions candidate on an H200)."""
    return [r for r in rules if (ops != "standard" or not r.contrib) and (provider != PROVIDERS["cuda"] or r.cuda)]
