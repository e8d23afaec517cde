"""Imports inside ess_jax flow one way, in the layer order ARCHITECTURE.md draws. Catches an
upward import between subpackages (e.g. model importing sampling), a circle between two modules
of one subpackage, a module importing its own package's face (`ess_jax.objectives` from inside
objectives/: a circle through __init__), and a private name imported across modules. Every
`import` counts, at the top of a module or inside a function, since a lazy import only defers
the circle; only `if TYPE_CHECKING:` imports (annotations, never run) are left out."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "ess_jax"
# Lowest first; a subpackage may import only from earlier layers and from itself.
LAYERS = (
    ("config",),
    ("data", "rewards"),
    ("parallel",),
    ("objectives",),
    ("model",),
    ("sampling",),
    ("io",),
    ("rl",),
    ("memory", "mismatch"),
    ("main",),
)
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _nodes(tree):
    """Every node, minus the bodies of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_nodes(child)])
            continue
        yield node
        yield from _nodes(node)


def _imports(path: pathlib.Path) -> list[tuple[str, tuple[str, ...]]]:
    """(imported module path under ess_jax, names taken) for every ess_jax import."""
    out = []
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ess_jax"):
            mod = node.module.removeprefix("ess_jax").lstrip(".")
            for a in node.names:  # `from ess_jax.x import y` may name a module y
                out.append((f"{mod}.{a.name}".lstrip("."), (a.name,)))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ess_jax."):
                    out.append((a.name.removeprefix("ess_jax."), ()))
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ".".join(path.relative_to(PKG).with_suffix("").parts)


def _unit(module: str) -> str:
    """The layer unit of a module path: its subpackage, or a top-level module's own name."""
    return module.split(".")[0]


def _graph() -> dict[str, set[str]]:
    known = {m for _, m in _modules()}
    graph = {}
    for path, mod in _modules():
        targets = set()
        for target, _ in _imports(path):
            while target and target not in known and f"{target}.__init__" not in known:
                target = target.rpartition(".")[0]  # `from ess_jax.x.y import name` -> x.y
            if target in known:
                targets.add(target)
            elif target:
                targets.add(f"{target}.__init__")
        graph[mod] = targets - {mod}
    return graph


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


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        if mod == "__init__":
            continue
        for t in targets:
            same = _unit(t) == _unit(mod)
            if same and t.endswith("__init__") and not mod.endswith("__init__"):
                bad.append(f"{mod} -> {t} (its own package's face)")
            elif not same and RANK[_unit(t)] >= RANK[_unit(mod)]:
                bad.append(f"{mod} -> {t}")
    return bad


def test_every_subpackage_has_a_layer():
    units = {_unit(m) for _, m in _modules()} - {"__init__"}
    assert units <= set(RANK), f"not in LAYERS: {sorted(units - set(RANK))}"


def test_imports_flow_down_the_layers_without_circles():
    graph = _graph()
    assert {"io.gguf_llama", "io.hf_layout"} <= graph["io.weights"]  # the parser sees imports
    assert _upward(graph) == []
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_private_name_is_imported_across_modules():
    private = [
        f"{m}: {name}"
        for path, m in _modules()
        for _, names in _imports(path)
        for name in names
        if name.startswith("_")
    ]
    assert private == []


def test_the_checks_find_planted_faults():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    planted = {"model.decoder": {"sampling.draw"}, "objectives.scopes": {"objectives.__init__"}}
    assert _upward(planted) == [
        "model.decoder -> sampling.draw",
        "objectives.scopes -> objectives.__init__ (its own package's face)",
    ]


# jax's transformations that take a derivative: the RL update takes them (rl/update.py,
# rl/accumulate.py), the objectives never do.
DERIVATIVES = {"grad", "value_and_grad", "vjp", "jvp", "jacfwd", "jacrev", "hessian", "linearize"}


def _root(node) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return getattr(node, "id", "")


def _derivatives(source: str) -> list[str]:
    """Every use of a jax derivative transformation in `source`: `jax.<name>` (any depth under
    jax) and `from jax... import <name>`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in DERIVATIVES and _root(node) == "jax":
            found.append(f"{node.lineno}: jax...{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
            names = [a.name for a in node.names if a.name in DERIVATIVES]
            found += [f"{node.lineno}: import {name}" for name in names]
    return found


def test_the_objectives_take_no_gradient():
    """Catches a gradient taken inside ess_jax/objectives (a value_and_grad, grad or vjp in a
    loss, a scope or a batch pass): the objectives are pure losses and statistics that the RL
    update differentiates. The planted uses are found, a non-jax `.grad` is not."""
    found = {
        str(path.relative_to(PKG)): uses
        for path in sorted((PKG / "objectives").rglob("*.py"))
        if (uses := _derivatives(path.read_text()))
    }
    assert found == {}
    planted = (
        "import jax\nfrom jax import vjp\n"
        "g = jax.value_and_grad(f)\nh = jax.grad(f)\nk = metrics.grad\n"
    )
    assert _derivatives(planted) == ["2: import vjp", "3: jax...value_and_grad", "4: jax...grad"]


def test_config_checks_import_none_of_the_async_runtime():
    """What `ess_jax.main` imports to check a config before any run (rl.experiment, and
    everything it imports, transitively) holds no module of the async runtime. Catches
    experiment.validate reaching the actor-learner (its threads, queue, pacing and the whole
    sampling stack) for the device split's check, which lives in rl.device_split."""
    graph = _graph()
    seen, todo = set(), ["rl.experiment"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(graph.get(m, ()))
    assert "rl.device_split" in seen
    assert not seen & {"rl.actor_learner", "rl.pacing", "rl.train", "rl.update"}, sorted(seen)


def test_the_loops_see_the_trainer_and_the_collector_not_run():
    """Catches the loops coupled back to `Run` (rl/train.py): actor_learner.py, trainer.py
    and collect.py must not import rl.train, and no function of theirs may take a `run`
    argument or read attributes off a name `run` (the actor-learner once read 14 of Run's
    attributes and wrote one)."""
    for name in ("actor_learner", "trainer", "collect"):
        path = PKG / "rl" / f"{name}.py"
        assert not [m for m, _ in _imports(path) if m in ("rl.train", "rl")], name
        for node in _nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.arg):
                assert node.arg != "run", (name, node.lineno)
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "run":
                raise AssertionError(f"{name}.py:{node.lineno} reads run.{node.attr}")
