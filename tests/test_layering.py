"""The package's layering (issues 23 and 38): every top-level module and package of tokenleap sits
on a floor, and none imports a floor above its own (at module level, inside a function or for
type checking alike); the engine knows only `drafters/base.py` and `drafters/spec.py` of the
drafters; and no module imports, at any depth and even inside a function, one that imports it back,
counting imports of packages (`from tokenleap import LLM`, `import tokenleap.drafters`: their
`__init__` runs) and the package `__init__`s an import runs on its way.

The floors: the ground (errors, paths, config, the small shared records, and `models/gguf_file.py`,
a GGUF reader that knows no model) < the request's text and sampling rules (tokenizer, sampling,
structured output, processors) < kernels < kv < attention < models < heads < drafters, verify <
engine < llm < the package's public face (`tokenleap/__init__.py`) < server, bench, train < ray < cli.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tokenleap.models.llama import LlamaModel

ROOT = Path(__file__).resolve().parent.parent / "src" / "tokenleap"
PACKAGE = "tokenleap"

# top-level module or package (or a module inside one, placed apart) -> its floor; "" = tokenleap/__init__.py
FLOORS: dict[str, int] = {
    "_omp_policy": 0, "_version": 0, "errors": 0, "paths": 0, "types": 0, "cost": 0, "threads": 0, "config": 0,
    # the file format's reader (the tokenizer reads a GGUF's metadata through it); imports only errors
    "models.gguf_file": 0,
    "tokenizer": 1, "sampling": 1, "structured": 1, "processors": 1,
    "kernels": 2,
    "kv": 3,
    "attention": 4,
    "models": 5,
    "heads": 6,
    "drafters": 7, "verify": 7,
    "engine": 8,
    "llm": 9,
    "": 10,
    "server": 11, "bench": 11, "train": 11,
    "ray": 12,
    "cli": 13,
}
ENGINE_SEES = ("tokenleap.drafters.base", "tokenleap.drafters.spec")  # of the drafters


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the module it runs: a submodule, or a package (its __init__)
    type_only: bool  # under `if TYPE_CHECKING:` (never runs)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _exists(module: str, root: Path) -> bool:
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import of the package in a file, wherever it sits (module level, functions,
    TYPE_CHECKING), as the modules it runs: `from tokenleap.drafters import methods` is the
    submodule `tokenleap.drafters.methods`, `from tokenleap import LLM` the package itself."""
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_lines(tree)
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{a.name}" if _exists(f"{base}.{a.name}", root) else base for a in node.names]
        for name in dict.fromkeys(names):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                found.append(Import(node.lineno, name, node.lineno in typing_only))
    return found


def floor_key(module: str) -> str:
    """The FLOORS key a module sits under: the longest one that names it or a package above it."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in FLOORS:
            return key
    return ""


def _files(root: Path = ROOT) -> list[Path]:
    return sorted(root.rglob("*.py"))


def test_every_top_level_module_has_a_floor() -> None:
    tops = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file())
    }
    tops.discard("__init__")
    assert tops - set(FLOORS) == set(), "place each new top-level module on a floor of FLOORS"
    assert {k.split(".")[0] for k in FLOORS if k} - tops == set(), "a floor names a module that is gone"


def upward_imports(root: Path = ROOT) -> list[str]:
    wrong = []
    for path in _files(root):
        source = module_name(path, root)
        key = floor_key(source)
        for imp in imports(path, root):
            target = floor_key(imp.module)
            where = f"{path.relative_to(root)}:{imp.line} imports {imp.module}"
            if target != key and FLOORS[target] > FLOORS[key]:
                wrong.append(f"{where} (floor {FLOORS[target]} above {FLOORS[key]})")
            elif key == "engine" and target == "drafters" and imp.module not in ENGINE_SEES:
                wrong.append(f"{where} (the engine sees only {', '.join(ENGINE_SEES)})")
    return wrong


def test_no_module_imports_a_floor_above_its_own_and_the_engine_sees_only_the_drafters_seam() -> None:
    assert upward_imports() == []


def _runs(importer: str, module: str) -> list[str]:
    """What importing `module` from `importer` executes: the module itself (a package: its
    `__init__`, even the importer's own package's), and the packages on its way that are not
    already running (the importer's own are)."""
    parts = module.split(".")
    own = {".".join(importer.split(".")[:n]) for n in range(1, importer.count(".") + 1)}
    on_the_way = [m for m in (".".join(parts[:n]) for n in range(1, len(parts))) if m not in own]
    return [m for m in (*on_the_way, module) if m != importer]


# imports that close a cycle, left to their owners' work: (importer, imported) -> why. The cycle
# test leaves these edges out, and fails when one is gone (remove it here) as when another appears.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules importing it runs (a package: its `__init__`), type-only imports left out."""
    graph: dict[str, set[str]] = {}
    for path in _files(root):
        name = module_name(path, root)
        graph[name] = {m for imp in imports(path, root) if not imp.type_only for m in _runs(name, imp.module)}
    return graph


def import_cycles(root: Path = ROOT, skip: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """Cycles of the import graph (one per edge that closes one in a depth-first walk), without the edges `skip`."""
    graph = import_graph(root)
    for importer, imported in skip:
        graph.get(importer, set()).discard(imported)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycle_anywhere_in_the_package() -> None:
    """No module imports, at any depth and even inside a function, one that imports it back (the
    head formats used to, through the EAGLE-3 loader; the method registry did, through the
    drafters' `__init__`)."""
    graph = import_graph()
    gone = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not gone, f"no longer imported: remove from KNOWN_CYCLE_EDGES {gone}"
    assert import_cycles(skip=KNOWN_CYCLE_EDGES) == []


def test_above_the_models_only_the_seam_is_known() -> None:
    """The engine, the drafters, the heads and `train/` type against `models.base.CausalLM`; only
    the loaders (`models/loading.py`) name the Llama implementation (issue 23, item 5)."""
    wrong = []
    for package in ("engine", "drafters", "heads", "train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            wrong += [
                f"{path.relative_to(ROOT)}:{i.line} imports {i.module}"
                for i in imports(path)
                if i.module == "tokenleap.models.llama"
            ]
    assert not wrong, wrong


def test_the_llama_model_implements_the_seam(tiny_model: LlamaModel) -> None:
    from tokenleap.models.base import CausalLM

    assert isinstance(tiny_model, CausalLM) and isinstance(tiny_model.with_layers(1), CausalLM)


def test_train_builds_on_the_heads_not_on_the_drafters() -> None:
    """The trainable heads share the runtime heads' shape and toolkit (`tokenleap.heads`) and
    import nothing of the drafters or the engine."""
    wrong, heads = [], set()
    for path in sorted((ROOT / "train").rglob("*.py")):
        for imp in imports(path):
            if imp.module.startswith(("tokenleap.drafters", "tokenleap.engine")):
                wrong.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}")
            if imp.module.startswith("tokenleap.heads"):
                heads.add(imp.module)
    assert not wrong, wrong
    assert "tokenleap.heads.base" in heads


# --------------------------------------------------------------------------- the test sees what it must


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake tokenleap tree under tmp_path with the given files (and empty `__init__`s)."""
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_the_layering_test_sees_an_upward_import(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "verify/chain.py": "from tokenleap.engine.speculation import expected_tokens\n",
            "config.py": "def f():\n    from tokenleap.drafters import methods\n",  # inside a function
            "tokenizer.py": "import tokenleap.models.loaders\n",
            "models/loaders.py": (  # types too
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenleap.heads import base\n"
            ),
            "kv/cache.py": "from tokenleap import LLM\n",  # the package's face
            "engine/engine.py": (
                "from tokenleap.drafters.ngram import NgramDrafter\nfrom tokenleap.drafters.spec import SpecConfig\n"
            ),
            "engine/speculation.py": "",
            "drafters/methods.py": "",
            "drafters/ngram.py": "",
            "drafters/spec.py": "",
            "heads/base.py": "",
        },
    )
    assert imports(root / "verify" / "chain.py", root) == [Import(1, "tokenleap.engine.speculation", False)]
    assert imports(root / "config.py", root) == [Import(2, "tokenleap.drafters.methods", False)]
    assert imports(root / "kv" / "cache.py", root) == [Import(1, "tokenleap", False)]
    wrong = upward_imports(root)
    for where in (
        "verify/chain.py:1", "config.py:2", "tokenizer.py:1", "models/loaders.py:3", "kv/cache.py:1",
        "engine/engine.py:1"
    ):
        assert any(w.startswith(where) for w in wrong), (where, wrong)
    assert not any(w.startswith("engine/engine.py:2") for w in wrong), wrong
    assert len(wrong) == 6, wrong


def test_the_cycle_check_sees_package_imports_and_functions(tmp_path: Path) -> None:
    """A registry that reads the built-in list from its package's `__init__`, inside a function,
    while the `__init__` imports a drafter that imports the registry: a cycle; the same through a
    TYPE_CHECKING import is none (it never runs)."""
    root = _package(tmp_path, {
        "drafters/__init__.py": "from tokenleap.drafters import ngram\n",
        "drafters/ngram.py": "from tokenleap.drafters.methods import MethodRecord\n",
        "drafters/methods.py": "def builtins():\n    from tokenleap.drafters import BUILTIN_METHODS\n",
        "engine/engine.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenleap.llm import LLM\n",
        "llm.py": "import tokenleap.engine.engine\n",
    })
    cycles = import_cycles(root)
    assert cycles and all("tokenleap.drafters" in c and "tokenleap.drafters.methods" in c for c in cycles), cycles
    assert not any("tokenleap.llm" in c for c in cycles), cycles
    (root / "drafters" / "methods.py").write_text("")
    assert import_cycles(root) == []
    (root / "engine" / "engine.py").write_text("def f():\n    import tokenleap\n")
    (root / "__init__.py").write_text("from tokenleap.llm import LLM\n")
    assert import_cycles(root), "tokenleap.engine.engine -> tokenleap (its __init__) -> llm -> engine.engine"


@pytest.mark.parametrize(
    "module, key",
    [
        ("tokenleap.models.gguf_file", "models.gguf_file"),
        ("tokenleap.models.llama", "models"),
        ("tokenleap", ""),
        ("tokenleap.drafters", "drafters"),
        ("tokenleap.cli", "cli"),
    ],
)
def test_floor_keys(module: str, key: str) -> None:
    assert floor_key(module) == key
