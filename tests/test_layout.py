"""The package's shape: its imports (function-local ones included) form no circle, and `rlflow optimize` with the
shipped agent loads no trainer."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlflow"

TRAINERS = ("rlflow.controller.wm_train", "rlflow.controller.ppo", "rlflow.controller.dream_ppo",
            "rlflow.controller.evaluate", "rlflow.controller.ship", "rlflow.controller.finetune",
            "rlflow.worldmodel.report", "rlflow.worldmodel.replay", "rlflow.worldmodel.dream",
            "rlflow.controller.real_episodes", "rlflow.controller.wm_config", "rlflow.controller.wm_learn",
            "rlflow.controller.wm_result")
"""Modules that train, evaluate or ship agents, or exist only for them."""


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body.  `from P import name` counts P.name when that
    is a module, else P; the parent packages Python imports on the way are not counted (every module would then
    import `rlflow/__init__.py`)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_imports_form_no_circle():
    graph = import_graph()
    assert "rlflow.controller.policy" in graph["rlflow.search.agent"]  # the walk sees function-local imports
    assert cycles(graph) == []


def test_the_world_model_imports_nothing_from_the_agents_above_it():
    """The world model (V, M, the dream, the location scorer) sits below the agents and trainers that use it
    (`rlflow.controller`: C, the actors, the world-model agent and its training, PPO, shipping), and the observation
    helpers both read sit below both: the two packages used to import each other."""
    graph = import_graph()
    upward = {(m, t) for m, targets in graph.items() if m.startswith("rlflow.worldmodel")
              for t in targets if t.startswith("rlflow.controller")}
    assert upward == set()
    assert "rlflow.worldmodel.location" in graph["rlflow.controller.wm_actor"]  # the walk sees the downward imports


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_optimize_with_the_shipped_agent_loads_no_trainer(tmp_path):
    from rlflow import zoo

    model = zoo.build("demo-block", tmp_path).path
    script = (f"import sys, json\nfrom rlflow.optimize import optimize\n"
              f"optimize({str(model)!r}, method='agent', time_limit=5, rounds=3)\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m in {TRAINERS!r})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RLFLOW_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert "rlflow.controller.wm_actor" in import_graph()["rlflow.search.agent"]
