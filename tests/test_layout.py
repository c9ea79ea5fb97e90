"""The package's layout: no import circle, no folder importing a folder above it, no oversized
file.

Reads the source with :mod:`ast` (nothing is imported), so every import counts, module-level and
inside functions alike, except those under ``if TYPE_CHECKING:``: annotations only, never run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbm_plugin"

# Bottom to top: one folder per role. A module may import its own folder and any folder below
# it, never one above. The card's top-level modules each take the place their imports give them.
RANKS: dict[str, int] = {
    "consolidator_config": 0,  # the settings' face: the standard library only
    "settings": 0,
    "_util": 1,
    "wire": 2,
    "tiers": 3,
    "naming": 3,
    "consolidator": 3,
    "events": 4,  # where GPU-tier events come from; event_sink.py is its face
    "event_sink": 5,
    "connector": 6,  # the seam: TensorRT-LLM's compat, the leader-worker metadata
    "leader": 7,
    "worker": 7,
    "connector_leader": 8,
    "connector_worker": 8,
    "__init__": 9,
    "routers": 10,  # models of the routers that read the streams
    "testing": 11,  # the simulated TensorRT-LLM
    "cli": 12,
}
MAX_LINES = 800


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every kvbm_plugin module ``path`` names in an import statement."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" \
        else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvbm_plugin"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("kvbm_plugin"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    return {m for m in found if m != "kvbm_plugin"}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


@functools.lru_cache(maxsize=1)
def _parsed_graph() -> tuple[tuple[str, frozenset[str]], ...]:
    """Every module's kvbm_plugin imports, parsed once for the tests below."""
    return tuple((_module_name(path), frozenset(m for m in _imports(path)
                                                if _exists(m) and m != _module_name(path)))
                 for path in SRC.rglob("*.py"))


def _graph() -> dict[str, set[str]]:
    """A fresh copy of the import graph (a test may add edges to it)."""
    return {name: set(deps) for name, deps in _parsed_graph()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_folder_has_a_rank() -> None:
    folders = {_folder(m) for m in _graph()}
    assert folders <= set(RANKS), sorted(folders - set(RANKS))


def test_no_folder_imports_a_folder_above_it() -> None:
    upward = sorted(f"{mod} -> {dep}" for mod, deps in _graph().items() for dep in deps
                    if RANKS[_folder(dep)] > RANKS[_folder(mod)])
    assert not upward, upward


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ is entered before any of its modules: count that edge too.
    for mod in list(graph):
        parent = mod.rpartition(".")[0]
        if parent and parent in graph and parent != "kvbm_plugin":
            graph[mod] = graph[mod] | {parent}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, deps = stack[-1]
            for dep in deps:
                if state.get(dep) == 1:
                    cycles.append(path[path.index(dep):] + [dep])
                elif dep not in state:
                    state[dep] = 1
                    path.append(dep)
                    stack.append((dep, iter(sorted(graph[dep]))))
                    break
            else:
                state[node] = 2
                stack.pop()
                path.pop()

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    assert not cycles, cycles


@pytest.mark.parametrize("suffix", [".py", ".c", ".h"])
def test_no_file_past_the_size_guide(suffix: str) -> None:
    big = {str(p.relative_to(SRC)): n for p in SRC.rglob(f"*{suffix}")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_a_blocks_name_is_asked_of_the_naming_face_only() -> None:
    """One module answers what a block is called (``naming/names.py``): every other module
    reaches the naming pieces (``naming/_*.py``) through it, so a new source of names (a
    KVCacheManagerV2 form, a router's spelling) has one place to land."""
    private = sorted(f"{mod} -> {dep}" for mod, deps in _graph().items() for dep in deps
                     if dep.startswith("kvbm_plugin.naming._")
                     and not mod.startswith("kvbm_plugin.naming"))
    assert not private, private
