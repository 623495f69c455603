"""sdflow's modules import each other without cycles (module-level and function-level imports,
TYPE_CHECKING ones included): a cycle hides an ordering dependency a later edit can break."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(package: str = "sdflow", root: Path = ROOT) -> dict[str, Path]:
    """The modules of the package at `root / package`, by their import names."""
    found: dict[str, Path] = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other sdflow modules, wherever in the module they are."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    imported.add(target)
        graph[name] = imported
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_import_graph_sdflow_modules_have_no_cycles() -> None:
    assert cycles(import_graph(_modules())) == []


def test_import_graph_layer_modules_have_no_cycles() -> None:
    assert cycles(import_graph(_modules("sdflow_common", ROOT / "layers" / "common"))) == []


def test_import_graph_image_modules_have_no_cycles() -> None:
    assert cycles(import_graph(_modules("sdflow_image", ROOT / "training_image"))) == []


# What may sit at the image package's top level: what every job shares. A job's modules go in its
# subpackage (download, dedup, training, serving, evaluation), the models of a family or backend in theirs,
# and the builders of tiny and random models, which no job imports, in builders.
IMAGE_SHARED_MODULES = {"__init__", "contract", "flags", "gpu_check", "holdout", "s3_uri", "scenes"}
IMAGE_SUBPACKAGES = {"backends", "builders", "dedup", "download", "evaluation", "families", "serving", "training"}


def test_image_package_top_level_only_shared_modules_and_job_subpackages() -> None:
    package = ROOT / "training_image" / "sdflow_image"
    modules = {p.stem for p in package.glob("*.py")}
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert modules == IMAGE_SHARED_MODULES
    assert subpackages == IMAGE_SUBPACKAGES


def test_image_jobs_never_import_builders() -> None:
    modules = _modules("sdflow_image", ROOT / "training_image")
    graph = import_graph(modules)
    importers = {
        name for name, imported in graph.items() if any(m.startswith("sdflow_image.builders") for m in imported)
    }
    assert {name for name in importers if not name.startswith("sdflow_image.builders")} == set()


def test_import_graph_function_level_cycle_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    graph = import_graph({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert cycles(graph) == [["a", "b"]]
