"""The project's modules form no import cycle (every import counts, including the lazy ones
inside functions), and the vocabulary modules import nothing from the project."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wan_s2v_runner", "runners", "patches")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        is_pkg = f.name == "__init__.py"
        base = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    src = f"{anchor}.{node.module}" if node.module else anchor
                else:
                    src = node.module or ""
                # "from pkg import sub" imports the submodule when there is one
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods:  # "a.b.name" -> the module that defines it
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_graph_is_read_from_the_sources():
    g = import_graph()
    assert "wan_s2v_runner.shared.spec" in g["wan_s2v_runner.launcher.cli"]  # sanity: edges are found
    assert "wan_s2v_runner.preflight.checks_parallel" in g["wan_s2v_runner.preflight.registry"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_vocabularies_import_nothing_from_the_project():
    g = import_graph()
    for leaf in ("wan_s2v_runner.shared.layout", "wan_s2v_runner.shared.stages", "wan_s2v_runner.shared.exit_codes"):
        assert g[leaf] == set(), (leaf, g[leaf])


def test_preflight_does_not_import_the_cli():
    g = import_graph()
    for mod, deps in g.items():
        if mod.startswith("wan_s2v_runner.preflight"):
            assert "wan_s2v_runner.launcher.cli" not in deps, mod
