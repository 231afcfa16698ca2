"""The package's shape: imports run one way down the declared layers (function-local ones included) and form no
circle, no module outgrows a screenful of screens, one module draws plots, the CLI is the one entry point, and
`rlflow optimize` with the shipped agent loads no trainer."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlflow"

LAYERS = (
    ("rlflow.cli",),
    ("rlflow.bench",),
    ("rlflow.optimize",),
    ("rlflow.train",),
    ("rlflow.search",),
    ("rlflow.agents",),
    ("rlflow.worldmodel",),
    ("rlflow.env",),
    ("rlflow.cluster",),
    ("rlflow.measure",),
    ("rlflow.rewrites",),
    ("rlflow.zoo",),
    ("rlflow.graph",),
    ("rlflow.errors", "rlflow.files", "rlflow.plots", "rlflow.torch_threads"),
)
"""The declared order, top to bottom: a module may import its own layer and the layers below it, never one above.
The trainers sit above what they train and below `rlflow.optimize` (its `--finetune` trains before it searches) and
the bench (which reads what a shipped agent trained on).  `rlflow.cluster` (what travels between Ray nodes) serves
the bench and the trainers and needs only measurement and graphs.  `rlflow/__init__.py`, the library's front door, may
import anything."""

MAX_LINES = 400
"""No module longer than this: past it a module has more than one concern (issue #48)."""

PLOTTING = "rlflow.plots"
"""The one module that imports matplotlib."""

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
    assert "rlflow.agents.policy" in graph["rlflow.search.agent"]  # the walk sees function-local imports
    assert cycles(graph) == []


def layer(module: str) -> int:
    """The index of `module`'s layer in `LAYERS` (0 is the top)."""
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no declared layer: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer than its importer."""
    return {(m, t) for m, targets in graph.items() if m != "rlflow" for t in targets
            if t != "rlflow" and layer(t) < layer(m)}


def test_imports_run_one_way_down_the_layers():
    graph = import_graph()
    assert upward_imports(graph) == set()
    assert "rlflow.worldmodel.location" in graph["rlflow.agents.actor"]  # the walk sees the downward imports


def test_an_upward_import_is_caught():
    assert upward_imports({"rlflow.graph.core": {"rlflow.search.greedy"}, "rlflow.search.greedy": set()}) == {
        ("rlflow.graph.core", "rlflow.search.greedy")}


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_only_the_plotting_module_imports_matplotlib():
    importers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "matplotlib" for n in names):
                importers.add(name)
    assert importers <= {PLOTTING}


def test_the_cli_is_the_one_entry_point():
    """The `rlflow` command (its `python -m rlflow.cli` included) is the only way in: no other module runs as a script
    (an `if __name__ == "__main__"` block) or is one (`__main__.py`)."""

    def runs_as_script(source: str) -> bool:
        return any(isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "__name__"
                   and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.comparators)
                   for node in ast.walk(ast.parse(source)))

    scripts = {name for name, path in modules().items()
               if path.name == "__main__.py" or runs_as_script(path.read_text())}
    assert scripts == {"rlflow.cli.__main__"}
    assert runs_as_script('if __name__ == "__main__":\n    main()\n') and not runs_as_script('"""__main__"""\n')


def test_only_the_command_layer_parses_arguments():
    """Issue #80: argument parsing lives in the `rlflow` command alone (`rlflow.cli` and its modules); the library's
    modules expose functions, so none imports argparse or reads `sys.argv`."""

    def parses_arguments(source: str) -> bool:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
                return True
            if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "argv" for a in node.names):
                return True
            if (isinstance(node, ast.Attribute) and node.attr == "argv" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                return True
        return False

    assert parses_arguments("def f():\n    import argparse\n") and parses_arguments("import sys\nx = sys.argv[1:]\n")
    assert parses_arguments("from sys import argv\n") and not parses_arguments("import sys\nsys.exit(0)\n")
    command_layer = LAYERS[0]
    parsers = {name for name, path in modules().items()
               if (name == "rlflow" or layer(name) != 0) and parses_arguments(path.read_text())}
    assert parsers == set(), f"only {', '.join(command_layer)} may parse arguments"
    assert parses_arguments((PACKAGE / "cli" / "__init__.py").read_text())  # the walk sees the command layer's


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_optimize_with_the_shipped_agent_loads_no_trainer(tmp_path):
    from rlflow import zoo

    trainers = sorted(name for name in modules() if name.startswith("rlflow.train"))
    model = zoo.build("demo-block", tmp_path).path
    script = (f"import sys, json\nfrom rlflow.optimize.pipeline import optimize\n"
              f"optimize({str(model)!r}, method='agent', time_limit=5, rounds=3)\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m in {trainers!r})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RLFLOW_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert "rlflow.agents.actor" in import_graph()["rlflow.search.agent"]


RESULTS = PACKAGE.parent / "docs" / "results"
RESULTS_MAX_BYTES = 15_000_000
RESULTS_MAX_FOLDERS = 100
"""Issue #80: docs/results/ keeps the runs the docs cite, not a lab notebook; superseded runs leave the tree (git
keeps them, and docs/results/README.md names the commit for each).  Folders as `find docs/results -type d` counts
them, the top one included."""


def test_the_results_stay_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    folders = 1 + sum(1 for p in RESULTS.rglob("*") if p.is_dir())
    assert size <= RESULTS_MAX_BYTES, f"docs/results holds {size / 1e6:.1f} MB (at most {RESULTS_MAX_BYTES / 1e6:g})"
    assert folders <= RESULTS_MAX_FOLDERS, f"docs/results has {folders} folders (at most {RESULTS_MAX_FOLDERS})"
