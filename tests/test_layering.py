"""The package's layering (issue 23): kernels < models < heads < drafters < engine, no module
importing a layer above its own, and the engine knowing only `drafters/base.py` of the drafters (it
keys drafters by `SpecConfig.drafter_key` and weighs cost with `tokenleap.cost`). The draft heads
(formats, loader, protocol) sit under the drafters that run them, and `train/` builds on the heads,
not on the drafters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "src" / "tokenleap"
LAYERS = {"kernels": 0, "models": 1, "heads": 2, "drafters": 3, "engine": 4}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenleap."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("tokenleap.")]
    return found


def test_no_layer_imports_a_layer_above_it_and_the_engine_sees_only_drafters_base() -> None:
    wrong = []
    for package, level in LAYERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in _imports(path):
                target = module.split(".")[1] if module.count(".") else ""
                if target not in LAYERS or target == package:
                    continue
                if LAYERS[target] > level or (package == "engine" and target == "drafters" and module != "tokenleap.drafters.base"):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, wrong


def test_above_the_models_only_the_seam_is_known() -> None:
    """The engine, the drafters, the heads and `train/` type against `models.base.CausalLM`; only
    the loaders (`models/loading.py`) name the Llama implementation (issue 23, item 5)."""
    wrong = []
    for package in ("engine", "drafters", "heads", "train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            wrong += [f"{path.relative_to(ROOT)}:{line} imports {m}" for line, m in _imports(path) if m == "tokenleap.models.llama"]
    assert not wrong, wrong


def test_the_llama_model_implements_the_seam(tiny_model) -> None:  # type: ignore[no-untyped-def]
    from tokenleap.models.base import CausalLM

    assert isinstance(tiny_model, CausalLM) and isinstance(tiny_model.with_layers(1), CausalLM)


def test_the_layering_test_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "chain.py"
    bad.write_text("from tokenleap.engine.speculation import expected_tokens\n")
    assert _imports(bad) == [(1, "tokenleap.engine.speculation")]


@pytest.mark.parametrize("package", ["drafters", "heads"])
def test_no_import_cycle_among_the_drafters_and_the_heads(package: str) -> None:
    """No drafter or head module imports, at any depth and even inside a function, one that
    imports it back (the head formats used to, through the EAGLE-3 loader)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package).glob("*.py"):
        graph[path.stem] = {m.split(".")[2] for _, m in _imports(path) if m.startswith(f"tokenleap.{package}.") and m.count(".") >= 2}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        for dep in graph.get(node, ()):
            visit(dep, [*stack, node])

    for module in graph:
        visit(module, [])
    assert not cycles, cycles


def test_train_builds_on_the_heads_not_on_the_drafters() -> None:
    """The trainable heads share the runtime heads' shape and toolkit (`tokenleap.heads`) and
    import nothing of the drafters or the engine."""
    wrong, heads = [], set()
    for path in sorted((ROOT / "train").rglob("*.py")):
        for line, module in _imports(path):
            if module.startswith(("tokenleap.drafters", "tokenleap.engine")):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if module.startswith("tokenleap.heads"):
                heads.add(module)
    assert not wrong, wrong
    assert "tokenleap.heads.base" in heads
