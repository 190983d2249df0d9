"""The house rules a reviewer would otherwise check by hand, read from the source
with ``ast`` (nothing is imported): no import cycle between ``encdec`` modules
(every import that can run counts: function-level ones and a package
``__init__``'s re-exports, eager or lazy), no module over 400 lines and no
function over 80, the comparison libraries (HF ``generate``, CTranslate2,
faster-whisper, jiwer) never imported at a module's top level, the checkout's
``benchmarks/`` and ``tests/`` never imported, beam search decided outside the
engine, no ``isinstance`` on a beam row class standing for a sampling type, and
every package says what it owns in its ``__init__`` docstring, and the live
turn state machine exists once."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "encdec"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# Top-level modules that bring in a comparison library: imported lazily, or only by benchmarks/.
COMPARISON_MODULES = ("ctranslate2", "faster_whisper", "jiwer", "transformers.generation")
# Names from ``transformers`` that carry HF ``generate`` (its model classes and pipelines).
HF_GENERATE_NAME = re.compile(r"ForConditionalGeneration$|MTModel$|^AutoModel|GenerationMixin|^pipeline$")


def _sources() -> dict[str, Path]:
    """Dotted module name -> file, for every module under encdec/."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


SOURCES = _sources()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules ``node`` (inside ``module``) imports: ``from a.b import c`` is
    ``a.b.c`` where that is a module, else ``a.b`` (a name that ``a.b``'s
    ``__init__`` defines or re-exports)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if SOURCES[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base for alias in node.names]


def _type_checking_imports(tree: ast.Module) -> set[int]:
    """The imports under ``if TYPE_CHECKING:``: they never run (annotations are strings
    under ``from __future__ import annotations``), so they are not edges."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _lazily_named(node: ast.AST) -> list:
    """The string constants ``node`` may name a module by for a lazy import."""
    if isinstance(node, ast.Dict):  # a table of lazy exports, name -> module or module -> names
        values = [*node.keys, *node.values]
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        values = node.args[:1]
    else:
        return []
    return [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def import_graph() -> dict[str, set[str]]:
    """``encdec`` module -> the ``encdec`` modules it imports anywhere in its file
    (``if TYPE_CHECKING:`` blocks aside), lazily named ones included: a module's dotted name as a value in a dict (a
    package's table of lazy exports, as ``encdec/__init__``'s, keyed by name or by module) or given to
    ``import_module``."""
    graph: dict[str, set[str]] = {name: set() for name in SOURCES}
    for name, tree in TREES.items():
        typing_only = _type_checking_imports(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            for value in _lazily_named(node):
                if value in SOURCES and value != name:
                    graph[name].add(value)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(name, node):
                    while target and target not in SOURCES:  # ``import encdec.a.b.c`` of a name: its module
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_edge_per_step(component: list[str], graph: dict[str, set[str]]) -> str:
    """One cycle through ``component``'s first module, as ``a -> b -> a``, for the message."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return " -> ".join(paths[v] + [start])
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(component)


def test_the_graph_reader_sees_every_kind_of_import():
    """The reader itself: relative, function-level, re-exported and lazily named imports are edges."""
    graph = import_graph()
    assert "encdec.entrypoints.llm" in graph["encdec"]  # the package's lazy re-export of LLM
    assert "encdec.attention.backends.abstract" in graph["encdec.attention"]  # an __init__'s re-export
    assert "encdec.bench" in graph["encdec.entrypoints.cli"]  # a function-level import
    assert "encdec.bench.common" in graph["encdec.bench.swap_bench"]  # ``from .common import``
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_encdec_modules():
    graph = import_graph()
    found = [_one_edge_per_step(c, graph) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_module_over_400_lines():
    long = {_rel(p): n for p in SOURCES.values() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = {}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    long[f"{_rel(SOURCES[name])}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _top_level_imports(tree: ast.Module):
    """Imports a module runs when it is imported: its body and the bodies of its
    top-level ``if``/``try``/``with``/class statements, not its functions."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]


def test_no_comparison_library_imported_at_module_level():
    """HF ``generate``, CTranslate2, faster-whisper and jiwer are what benchmarks/
    compares with; the package may reach them only inside a function."""
    found = []
    for name, tree in TREES.items():
        for node in _top_level_imports(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad = [m for m in modules if m.split(".")[0] in COMPARISON_MODULES or m.startswith(COMPARISON_MODULES)]
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                bad += [a.name for a in node.names if HF_GENERATE_NAME.search(a.name)]
            if bad:
                found.append(f"{_rel(SOURCES[name])}:{node.lineno} {bad}")
    assert not found, "module-level imports of comparison libraries:\n" + "\n".join(found)


def test_the_package_never_imports_the_checkout():
    """benchmarks/ and tests/ are not in the wheel: no encdec module may import them, even lazily."""
    found = [f"{_rel(SOURCES[name])}:{node.lineno}" for name, tree in TREES.items() for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
             and any(m.split(".")[0] in ("benchmarks", "tests")
                     for m in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]))]
    assert not found, f"encdec modules importing benchmarks/ or tests/: {found}"


def test_the_engine_does_not_run_beam_search():
    """The scheduler applies beam decisions the sampler made; the engine only moves a step's outputs."""
    found = [f"{_rel(p)}:{i}" for p in sorted((PACKAGE / "engine").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "beam_search" in line]
    assert not found, f"beam_search in encdec/engine: {found}"


def test_no_isinstance_on_a_beam_row_class():
    """Beam search is a sampling type on the params, not a row class to test for."""
    pattern = re.compile(r"isinstance\(.*" + "BeamRow" + "Params")
    found = [f"{_rel(p)}:{i}" for top in ("encdec", "tests", "benchmarks", "examples")
             for p in sorted((ROOT / top).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, f"isinstance on BeamRowParams: {found}"


PACKAGES = sorted(d for d in PACKAGE.rglob("*") if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")))


@pytest.mark.parametrize("package", [PACKAGE, *PACKAGES], ids=lambda d: _rel(d))
def test_every_package_says_what_it_owns(package):
    init = package / "__init__.py"
    assert init.exists(), f"{_rel(package)} has no __init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{_rel(init)} has no docstring saying what the package owns"


def test_a_table_of_lazy_exports_keyed_by_module_is_an_edge():
    assert "encdec.quantization.passes" in import_graph()["encdec.quantization"]


def test_the_live_turn_state_machine_exists_once():
    """Both live front ends drive ``LiveSession``; turn state lives in ``transcription/live`` alone."""
    for front_end in ("encdec/entrypoints/openai/realtime.py", "encdec/transcription/stream.py"):
        assert "LiveSession(" in (ROOT / front_end).read_text(), front_end
    turn_classes = {name for name, tree in TREES.items() for node in ast.walk(tree)
                    if isinstance(node, ast.ClassDef) and node.name.endswith(("Turn", "TurnEnded"))}
    assert {n for n in turn_classes if not n.startswith("encdec.transcription.live.")} == set(), turn_classes
