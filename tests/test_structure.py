"""The shape of the code base, checked: no import cycles, the library below the orchestrator, and
``lopd_core`` importable without the orchestration and storage packages.

Nodes of the package graph are the sub-packages (``lopd_core.memory``, ``lopd_core.records``, ``flows``,
``lopd_cli``, ``data_contracts``…) and, for the modules directly under ``lopd_core/``, each module on its
own (``lopd_core.losses`` sits below ``lopd_core.algorithms``, ``lopd_core.training`` above it). Every
import counts, those inside functions too; only ``if TYPE_CHECKING:`` blocks are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lopd_core", "lopd_cli", "flows", "data_contracts")
BLOCKED = ("prefect", "mlflow", "lancedb", "pandera")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name ``module`` imports (absolute, with relative imports resolved)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    graph = defaultdict(set)
    for name, path in mods.items():
        for target in imported_names(path, name):
            resolved = resolve(target)
            if resolved and resolved != name and not name.startswith(resolved + "."):
                graph[name].add(resolved)
    return graph


def unit(module: str) -> str:
    """The package-graph node of a module (see the module docstring)."""
    parts = module.split(".")
    if parts[0] != "lopd_core" or len(parts) == 1:
        return parts[0]
    is_package = (ROOT.joinpath(*parts[:2])).is_dir()
    return ".".join(parts[:2]) if is_package else module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    nodes = set(graph) | {t for targets in graph.values() for t in targets}

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_there_are_no_module_cycles():
    assert cycles(import_graph()) == []


def test_there_are_no_package_cycles():
    graph = defaultdict(set)
    for source, targets in import_graph().items():
        for target in targets:
            if unit(source) != unit(target):
                graph[unit(source)].add(unit(target))
    assert cycles(graph) == []


def test_the_library_never_imports_the_orchestrator_or_the_cli():
    wrong = sorted(f"{source} -> {target}" for source, targets in import_graph().items() if source.startswith("lopd_core")
                   for target in targets if target.split(".")[0] in ("flows", "lopd_cli"))
    assert wrong == []


def test_the_records_layer_imports_nothing_else_of_the_project():
    wrong = sorted(f"{source} -> {target}" for source, targets in import_graph().items()
                   if source.startswith("lopd_core.records") for target in targets
                   if not target.startswith("lopd_core.records"))
    assert wrong == []


def test_the_cycle_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_library_module_imports_with_the_orchestration_and_storage_packages_blocked():
    """A GPU machine may have only torch, transformers and peft: ``lopd_core`` must import without the rest."""
    names = sorted(m for m in modules() if m.startswith("lopd_core") and not m.endswith("_sandbox_launcher"))
    script = f"""
import importlib, importlib.abc, sys
BLOCKED = {BLOCKED!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked for this test: {{name}}")
        return None
sys.meta_path.insert(0, Block())
failed = []
for name in {names!r}:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{{name}}: {{exc}}")
print("\\n".join(failed))
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("LEAKED", leaked)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "LEAKED []"
    assert lines[:-1] == [], "modules that need a blocked package at import time:\n" + "\n".join(lines[:-1])


def test_every_document_and_report_folder_the_repository_names_exists():
    """A reference to ``docs/<name>.md`` or ``reports/<folder>`` in any tracked file points at something in it."""
    import re

    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    pattern = re.compile(r"(?<![\w/.-])((?:docs/[\w.-]+\.md)|(?:reports/[\w.-]+\d{4}-\d{2}-\d{2}))")
    missing = set()
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", "") or not path.is_file():
            continue
        for ref in pattern.findall(path.read_text(errors="ignore")):
            if not (ROOT / ref).exists():
                missing.add(f"{name}: {ref}")
    assert sorted(missing) == []
