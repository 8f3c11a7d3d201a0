"""deepinfer/'s import graph: no circles, and every layer imports only its own and lower ones.

The graph is read from the source (ast), not by importing it. An edge is one module naming
another in an import statement, of one of three kinds: at module level (runs at import), inside a
function (runs when called), or under `if TYPE_CHECKING:` (type checkers only). `from P import
name` is an edge to P.name where that is a module, else to P. Importing a submodule also runs
its parent packages' __init__; those implied edges are not counted (as grimp / import-linter).

    python tests/test_import_layers.py      prints the cycles of each kind and any layer breach
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "deepinfer"
KINDS = ("module", "function", "typing")

# Cycles that may stay, each a set of modules with the reason. The models read their tensors
# through deepinfer.models.weights.WeightSource (the loader implements it, the models do not
# import the loader), and the data-parallel executor is handed LLM.from_engine by the API
# instead of importing it.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
    frozenset({"deepinfer.models.config", "deepinfer.models.config_v41"}): (
        "ModelConfig.from_dict parses deepseek_v41 through config_v41 (a function-level import), "
        "which builds on config's field readers; to be split into a shared fields module"
    ),
}

# Lowest first; a module belongs to the layer of its longest matching prefix and may import
# modules of its own layer or lower ones.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the switch table (deepinfer.envs) and the contract with its reference backend (optional ops
    # default to the reference's)
    (
        "contract",
        ("deepinfer.envs", "deepinfer.log", "deepinfer.config", "deepinfer.backend", "deepinfer.reference"),
    ),
    ("parallel", ("deepinfer.parallel",)),  # expert parallelism over the contract's collectives
    ("models", ("deepinfer.models",)),
    # the engine, and vLLM's view of the served model it gives (model_config)
    ("engine", ("deepinfer.engine", "deepinfer.model_config")),
    # conformance suite, random checkpoints and models, float64 oracles, the paged test driver
    ("testing", ("deepinfer.testing",)),
    # what LLM(data_parallel_size=N) runs: above the engine, below the API that starts it
    ("executor", ("deepinfer.entrypoints.data_parallel",)),
    # the offline API, its beam search and metrics, and vLLM's import paths (inputs, sampling_params,
    # outputs, logprobs, v1.metrics.reader)
    (
        "api",
        (
            "deepinfer.api",
            "deepinfer.inputs",
            "deepinfer.sampling_params",
            "deepinfer.outputs",
            "deepinfer.logprobs",
            "deepinfer.beam_search",
            "deepinfer.metrics",
            "deepinfer.v1",
        ),
    ),
    ("entrypoints", ("deepinfer.entrypoints", "deepinfer.cli", "deepinfer.__main__")),
]
# deepinfer/__init__.py (the version, lazy exports of the API) is the package's face: no layer.
UNLAYERED = {"deepinfer"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[tuple[str, ...], str]]:
    """(the names an import statement may mean, most specific first; its kind) for each
    import under `tree`."""

    def visit(node: ast.AST, kind: str) -> Iterable[tuple[tuple[str, ...], str]]:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "module":
                inner = "function"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "typing"
            if isinstance(child, ast.Import):
                yield from (((alias.name,), inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against this module's package
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - child.level + 1]
                    base = ".".join([*package, *([child.module] if child.module else [])])
                yield from (((f"{base}.{alias.name}", base), inner) for alias in child.names)
            yield from visit(child, inner)

    yield from visit(tree, "module")


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """module -> {module it imports: the strongest kind of edge (module > function > typing)}."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for module, path in paths.items():
        edges: dict[str, str] = {}
        for names, kind in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            target = next((n for n in names if n in paths), None)  # None: outside deepinfer/
            if target is None or target == module:
                continue
            edges[target] = min(kind, edges.get(target, kind), key=KINDS.index)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, str]], kinds: Iterable[str]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module over edges of `kinds`
    (Tarjan's algorithm)."""
    kinds = set(kinds)
    edges = {m: [t for t, k in out.items() if k in kinds] for m, out in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer (its longest matching prefix), None if unlayered."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (i, len(prefix))
    return None if best is None else best[0]


def layer_breaches(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every import of a higher layer, as "importer (layer) -> imported (layer), kind"."""
    out = []
    for module, imported in sorted(graph.items()):
        low = layer_of(module)
        for target, kind in sorted(imported.items()):
            high = layer_of(target)
            if low is not None and high is not None and high > low:
                out.append(f"{module} ({LAYERS[low][0]}) -> {target} ({LAYERS[high][0]}), {kind}")
    return out


GRAPH = import_graph()


@pytest.mark.parametrize(
    "kinds", [KINDS[:1], KINDS[:2], KINDS], ids=["module", "module+function", "module+function+typing"]
)
def test_no_import_cycles(kinds: tuple[str, ...]) -> None:
    found = cycles(GRAPH, kinds)
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import cycles over {'+'.join(kinds)} edges: {unexpected}"


def test_allowed_cycles_still_exist() -> None:
    """An allowed cycle that is gone leaves the list (it would hide a new one of the same modules)."""
    found = set(cycles(GRAPH, KINDS))
    assert [sorted(c) for c in ALLOWED_CYCLES if c not in found] == []


def test_layers_import_downwards() -> None:
    assert layer_breaches(GRAPH) == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in GRAPH if layer_of(m) is None and m not in UNLAYERED] == []


def test_the_checker_sees_each_kind(tmp_path: Path) -> None:
    """A made-up package with one cycle of each kind: the checker finds each where it should."""
    pkg = tmp_path / "deepinfer"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from deepinfer import b\n",
        "b.py": "import deepinfer.a\n\ndef f():\n    from deepinfer.sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import f\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["deepinfer.a"] == {"deepinfer.b": "module"}
    assert graph["deepinfer.sub.c"] == {"deepinfer.b": "typing"}
    assert cycles(graph, KINDS[:1]) == [frozenset({"deepinfer.a", "deepinfer.b"})]
    assert sorted(map(sorted, cycles(graph, KINDS))) == [["deepinfer.a", "deepinfer.b", "deepinfer.sub.c"]]


if __name__ == "__main__":
    for n in range(1, len(KINDS) + 1):
        print(
            f"cycles over {'+'.join(KINDS[:n])} edges:",
            [sorted(c) for c in cycles(GRAPH, KINDS[:n])] or "none",
        )
    print("layer breaches:", layer_breaches(GRAPH) or "none")
    sys.exit(0)
