"""The layout's import rules, read from the sources: no module imports one that imports it back (imports
inside functions included), and the packages never import train.py or scripts/."""

import ast
from pathlib import Path

from tests.train_helpers import ROOT

PACKAGES = ("configs", "data", "eval", "kernels", "model", "run")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    files = [ROOT / "train.py"] + [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return {module_name(p): p for p in files}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules that `path` imports anywhere in its body. `from pkg import sub` names the
    submodule where one exists; a module importing its own package's submodules is not a cycle."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = sources()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_several_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_import_cycles():
    edges = graph()
    assert "kernels.fused.products" in edges["kernels.fused.mlp"]  # the graph sees the operators' imports
    assert "kernels.fused.gemm_hopper" in edges["kernels.fused.products"]  # ... and those inside functions
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_packages_do_not_import_the_entry_point_or_scripts():
    for name, deps in graph().items():
        if name != "train":
            assert not {d for d in deps if d == "train" or d.startswith("scripts")}, name
