"""fdp's import structure: layers, no import cycles, and the CPU backend behind its seam.

Read from the source (every ``import`` statement, those inside functions too), not
from what an import happens to load. A module's layer is that of the longest prefix
in ``LAYERS``; a module may import its own layer and those below, never above.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fdp"

# The pipeline of docs/design.md, lowest first.
LAYERS = {
    # 0. Foundations: JAX's internals (failing closed), the jaxpr walk, validation, logging.
    "fdp._compat": 0,
    "fdp._jaxpr": 0,
    "fdp._version": 0,
    "fdp._validate": 0,
    "fdp._process": 0,
    "fdp._extended": 0,
    "fdp.observe._debug": 0,
    # 1. What the step is built on: collectives, buckets, host runtime, data placement,
    #    layers, and the observations the step records (stats, fingerprint, HLO reading).
    "fdp.collectives": 1,
    "fdp.bucketing": 1,
    "fdp.runtime": 1,
    "fdp.data": 1,
    "fdp.nn": 1,
    "fdp.observe._stats": 1,
    "fdp.observe._hlo": 1,
    "fdp.observe._fingerprint": 1,
    # The NNX comm-hook state holder (plain flax): checkpoints name it to move fdp
    # 0.1's layout (runtime/_ckpt_legacy.py), so it sits below them, not with the step.
    "fdp.step.core._comm_state": 1,
    # 2. Comm hooks and the bucketed reduction.
    "fdp.hooks": 2,
    # 3. Platform backends (fdp.backends.cpu) and the dispatch that picks one.
    "fdp.backends": 3,
    # 4. The step, and what a step or fdp.init calls into a backend from.
    "fdp.step": 4,
    "fdp.observe._observer": 4,
    "fdp.runtime._init": 4,
    # 5. Public surfaces, reports and tools.
    "fdp": 5,
    "fdp.runtime.__init__": 5,
    "fdp.observe": 5,
    "fdp.launch": 5,
    "fdp.cli": 5,
    "fdp.__main__": 5,
}

# Inside the step (layer 4), its folders in the order the call path is built: each
# imports only those before it. The builders (_build: fdp.train_step, nnx_train_step,
# tune) sit on top, so the tuner and the front ends never import each other's builders.
STEP_ORDER = ("layout", "options", "grads", "core", "front", "tune", "_build")

BACKEND = "fdp.backends.cpu"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts)] = path  # a package as "fdp.x.__init__"
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` (a module, a package or a name in one) loads from."""
    while name:
        if name in MODULES:
            return name
        if f"{name}.__init__" in MODULES:
            return f"{name}.__init__"
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """The fdp modules ``module`` imports, resolved to files."""
    path = MODULES[module]
    package = module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name) if name.startswith("fdp") else None
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def layer(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    name = module.removesuffix(".__init__")
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    raise AssertionError(f"{module} has no layer: add it to LAYERS")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a)
    ]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_module_imports_from_a_higher_layer():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, cycles


def _step_part(module: str) -> int | None:
    """Where ``module`` stands in :data:`STEP_ORDER` (None: not a part of fdp.step)."""
    parts = module.split(".")
    if parts[:2] != ["fdp", "step"] or len(parts) < 3 or parts[2] == "__init__":
        return None
    return STEP_ORDER.index(parts[2])


def _step_upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} imports {b}"
        for a, targets in graph.items()
        if (at := _step_part(a)) is not None
        for b in targets
        if (bt := _step_part(b)) is not None and bt > at
    ]


def test_the_step_folders_import_only_those_below():
    upward = _step_upward(GRAPH)
    assert not upward, "\n".join(upward)
    assert {m.split(".")[2] for m in MODULES if _step_part(m) is not None} == set(STEP_ORDER)


def test_generic_code_never_imports_the_cpu_backend():
    """Only the backend itself and the dispatch (fdp.backends) may import fdp.backends.cpu."""
    allowed = {"fdp.backends.__init__"}
    leaks = [
        f"{a} imports {b}"
        for a, targets in GRAPH.items()
        if a not in allowed and not a.startswith(BACKEND + ".")
        for b in targets
        if b.startswith(BACKEND + ".")
    ]
    assert not leaks, "\n".join(leaks)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from fdp.backends.cpu import _shm\n", {"fdp.backends.cpu._shm"}),
        ("import fdp.backends.cpu._fold\n", {"fdp.backends.cpu._fold"}),
        ("def f():\n    from fdp.backends import cpu\n", {"fdp.backends.cpu.__init__"}),
    ],
)
def test_the_checks_see_imports_of_every_form(tmp_path, monkeypatch, source, expected):
    """A check that cannot see an import cannot fail: each spelling is read."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "fdp.step._probe", path)
    assert _imports("fdp.step._probe") == expected


def test_the_checks_flag_an_upward_import_and_a_cycle():
    graph = {
        "fdp.hooks._basic": {"fdp.step.options._config"},
        "fdp.step.options._config": {"fdp.hooks._basic"},
    }
    assert _upward(graph) == [
        "fdp.hooks._basic (layer 2) imports fdp.step.options._config (layer 4)"
    ]
    assert _cycles(graph) == [{"fdp.hooks._basic", "fdp.step.options._config"}]
    # The circle this layout removed: a front end importing the tuner that builds it.
    tuner = {"fdp.step.front._linen": {"fdp.step.tune._tune"}}
    assert _step_upward(tuner) == ["fdp.step.front._linen imports fdp.step.tune._tune"]
    assert layer("fdp.runtime._store") < layer("fdp.backends.cpu._shm") < layer("fdp.runtime._init")
