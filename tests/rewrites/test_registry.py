"""The registry: names, groups, the append-only order, documentation, and the README example (which runs as
written)."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from onnx import TensorProto

from rlflow.rewrites import GROUP_NAMES, PRECISION_RULES, REGISTRY_VERSION, RULES, match_counts, rule
from rlflow.rewrites.base import registry_version

from .helpers import graph, node
from .test_matches import CASE_MODULES

PACKAGE = Path(__file__).resolve().parents[2] / "rlflow"
README = PACKAGE / "rewrites" / "README.md"


def test_registry_shape():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names)) >= 50
    assert names[:2] == ["transpose-transpose", "conv-bn-fold"]  # the first published action ids
    assert {r.group for r in RULES} == set(GROUP_NAMES) - {"precision"}  # exact: precision has a table of its own
    assert {r.group for r in PRECISION_RULES} == {"precision"}
    assert REGISTRY_VERSION == registry_version(RULES)
    assert all(r.description.startswith("Replaces ") and r.description.endswith(".") for r in RULES)


def test_every_rule_has_a_case():
    covered = set()
    for module in CASE_MODULES:
        covered |= set(module.CASES)
    assert covered == {r.name for r in RULES}


def test_contrib_flag_matches_what_rules_emit():
    contrib = {r.name for r in RULES if r.contrib}
    assert contrib == {"skip-layernorm-fusion", "gelu-fusion", "fast-gelu-fusion", "conv-activation-fusion",
                       "gemm-activation-fusion", "matmul-transpose-fusion", "bias-gelu-fusion", "bias-fast-gelu-fusion",
                       "attention-fusion", "bias-gelu-unfuse", "attention-pack-qkv", "embed-layernorm-fusion",
                       "rmsnorm-fusion", "skip-rmsnorm-fusion", "skip-rmsnorm-unfuse",
                       "rotary-fusion", "decoder-attention-fusion", "group-query-attention-fusion",
                       "group-query-attention-rotary", "group-query-attention-pack-qkv",
                       "group-query-attention-causal", "tied-head-fusion", "quick-gelu-fusion"}


def test_groups_cover_every_rule_once():
    from rlflow.rewrites import GROUPS

    assert list(GROUPS) == ["merge", "algebra", "fold", "layout", "fusion", "inverse", "precision"]
    names = [r.name for group in GROUPS.values() for r in group]
    assert sorted(names) == sorted(r.name for r in RULES + PRECISION_RULES) and all(GROUPS.values())
    assert all(r in GROUPS[r.group] for r in RULES + PRECISION_RULES)


def test_the_shipped_agents_registry_is_a_prefix_of_this_one():
    """Append only: each shipped checkpoint's rules are the first rules of RULES, in its order (a line inserted, moved
    or renamed in `registry.py` shifts every action id after it, and the shipped agents would refuse to load)."""
    shipped = sorted((PACKAGE / "checkpoints").glob("*.json"))
    assert shipped
    for meta in shipped:
        info = json.loads(meta.read_text())
        assert registry_version(RULES[:info["rules"]]) == info["registry_version"], meta.name


def test_the_registry_tables_comments_name_each_rules_action_id():
    """`registry.py` writes `# <action id> <name>` beside each rule; a line added with a wrong comment misleads."""
    text = (PACKAGE / "rewrites" / "registry.py").read_text()
    comments = re.findall(r"^    \w+\.\w+\(group=\"\w+\"\),\s+# *(\d+) ([a-z0-9-]+)$", text, flags=re.M)
    assert comments == ([(str(i), r.name) for i, r in enumerate(RULES)]
                        + [(str(i), r.name) for i, r in enumerate(PRECISION_RULES)])


def test_contrib_roots_only_where_declared():
    assert all(r.domains == ("", "ai.onnx") for r in RULES if not r.name.endswith("-unfuse")
               and r.name not in ("bias-gelu-fusion", "bias-fast-gelu-fusion", "attention-pack-qkv",
                                  "group-query-attention-rotary", "group-query-attention-pack-qkv",
                                  "group-query-attention-causal"))


def test_rule_lookup():
    assert rule("conv-bn-fold") is RULES[1]
    with pytest.raises(KeyError):
        rule("no-such-rule")


def test_match_counts_lists_every_rule():
    g = graph([node("Identity", ["x"], "t"), node("Relu", ["t"])], {"x": [2, 3]})
    counts = match_counts(g)
    assert list(counts) == [r.name for r in RULES]
    assert counts["identity-elim"] == 1 and sum(counts.values()) == 1


def test_readme_lists_every_rule():
    text = README.read_text()
    for r in RULES:
        assert f"| `{r.name}` | {r.group} |" in text, r.name


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for code in blocks:
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    assert "matmul-merge-siblings" in out.getvalue()


def test_custom_domain_look_alikes_are_left_alone():
    from rlflow.rewrites import find_matches

    g = graph([node("Relu", ["x"], "t", domain="my.ops"), node("Relu", ["t"], "u", domain="my.ops"),
               node("Split", ["u"], ["p", "q"], axis=1), node("Tanh", ["p"], "a", domain="my.ops"),
               node("Tanh", ["q"], "b", domain="my.ops"), node("Concat", ["a", "b"], axis=1)], {"x": [2, 4]},
              outputs={"y": (TensorProto.FLOAT, [2, 4])}, custom=("my.ops",))
    assert find_matches(g) == []
