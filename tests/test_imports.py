"""Imports inside ess_jax flow one way. Catches a circle between two modules (weights <->
gguf_llama had one, hidden by a lazy import): every `import` counts, at the top of a module
or inside a function, since a lazy import only defers the circle; only `if TYPE_CHECKING:`
imports (annotations, never run) are left out."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "ess_jax"


def _nodes(tree):
    """Every node, minus the bodies of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_nodes(child)])
            continue
        yield node
        yield from _nodes(node)


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "ess_jax":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ess_jax."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("ess_jax.")}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycles_in_the_package():
    graph = {p.stem: _imports(p) - {p.stem} for p in PKG.glob("*.py")}
    assert graph["weights"] >= {"gguf_llama", "hf_layout"}  # the parser sees real imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
