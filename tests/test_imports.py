"""Imports go one way (issue 36): read from the AST of every file in pagedllm/, lazy imports inside functions
included (a lazy import is still a dependency; only `if TYPE_CHECKING:` blocks are left out).

Layers, lowest first: the shared data (top-level modules: config, sampling_params, step_input, outputs, ...),
then memory/, model_executor/, executor/, distributed/ (what runs a model), then engine/, then entrypoints/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"
LOWER = ("pagedllm.memory", "pagedllm.model_executor", "pagedllm.executor", "pagedllm.distributed",
         "pagedllm.config")
UPPER = ("pagedllm.engine", "pagedllm.entrypoints")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The pagedllm modules one import statement names (`from a import b`: a.b when b is a module, else a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the pagedllm modules it imports."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        graph[module] = set().union(*(
            _imported(module, path.name == "__init__.py", node, known) for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each lower-layer module importing from engine/ or entrypoints/, and for config.py importing
    anything below the top level (it is the base every layer reads)."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if module.startswith(LOWER) and target.startswith(UPPER):
                found.append(f"{module} -> {target}")
            elif module == "pagedllm.config" and target.count(".") > 1:
                found.append(f"{module} -> {target}")
    return found


def test_no_two_files_import_each_other_even_through_others():
    assert circles(import_graph()) == []


def test_no_lower_layer_imports_from_the_engine_or_the_entrypoints():
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize("case", ["circle", "upward"])
def test_the_check_fails_on_a_new_one(tmp_path, case):
    """The same check over a small package written here: it finds what it is meant to find."""
    root = tmp_path / "pagedllm"
    for folder in ("engine", "memory"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "engine" / "arg_utils.py").write_text("from pagedllm.memory import dry_run\n")
    if case == "circle":
        (root / "memory" / "dry_run.py").write_text("def plan():\n    from pagedllm.engine.arg_utils import x\n")
        assert circles(import_graph(root)) == [["pagedllm.engine.arg_utils", "pagedllm.memory.dry_run"]]
    else:
        (root / "memory" / "dry_run.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm.engine import arg_utils\n"
            "from ..engine import arg_utils\n")
        assert upward_imports(import_graph(root)) == ["pagedllm.memory.dry_run -> pagedllm.engine.arg_utils"]


ENGINE_INTERNALS = ("scheduler", "kv_cache", "executor", "runner", "driver")


def engine_internals_read(root: Path = PACKAGE) -> list[str]:
    """`file:line engine.attr` for each read, outside engine/, of an engine attribute that is private or names the
    scheduler, the KV cache manager or the runner (what EngineStats and the engine's methods are for). An engine
    is any expression whose last name is `engine` or `llm_engine`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            name = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(holder, ast.Attribute) else ""
            if name in ("engine", "llm_engine") and (node.attr in ENGINE_INTERNALS or node.attr.startswith("_")):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}.{node.attr}")
    return found


def test_nothing_outside_the_engine_reads_its_scheduler_kv_cache_or_runner():
    assert engine_internals_read() == []


def test_the_engine_internals_check_finds_a_read(tmp_path):
    root = tmp_path / "pagedllm"
    (root / "entrypoints").mkdir(parents=True)
    (root / "entrypoints" / "api.py").write_text("def f(ctx):\n    return ctx.engine.scheduler.waiting, ctx.engine.stats()\n")
    assert engine_internals_read(root) == ["pagedllm/entrypoints/api.py:2 engine.scheduler"]
