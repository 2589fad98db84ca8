"""Arrows run down only: every ``tpspec`` import in the package (at module level or inside a
function) goes to a layer at or below the importer's, read from the source with ``ast``."""

from __future__ import annotations

import ast
import pathlib

import tpspec

# Bottom to top. The rank side (distributed … worker) never imports the driver (executor, engine,
# server, …); configs import no engine part.
LAYERS = [
    {"config", "sampling_params", "cpu_features", "default_model"},
    {"structured"},  # grammars (xgrammar): the driver checks them, every rank follows them
    {"distributed"},  # collectives only
    {"sample"},
    {"layers"},
    {"models"},
    {"spec_decode"},  # rank side of speculative decoding
    {"worker"},
    {"executor"},  # processes: spawns workers
    {"tokenizer", "engine"},  # the driver
    {"llm", "server", "train", "bench"},
    {"cli", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
ROOT = pathlib.Path(tpspec.__file__).parent


def _part(module: str) -> str | None:
    """The top-level part of a ``tpspec.…`` module name (None: not tpspec, or the package itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tpspec" and len(parts) > 1 else None


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every tpspec import in the file; ``from tpspec import x`` counts as tpspec.x."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tpspec":
                out += [(node.lineno, f"tpspec.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if _part(m) is not None]


def _importer_part(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    return path.relative_to(root).parts[0].removesuffix(".py")


def upward_imports(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        part = _importer_part(path, root)
        if part == "__init__":
            continue  # the package's lazy LLM / SamplingParams attributes
        for line, module in _imports(path):
            target = _part(module)
            if RANK[target] > RANK[part]:
                bad.append(f"{path.relative_to(root)}:{line} ({part}) imports {module} ({target})")
    return bad


def test_every_part_has_a_layer():
    parts = {_importer_part(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert parts <= set(RANK), f"parts with no layer: {sorted(parts - set(RANK))}"


def test_no_import_runs_back_up():
    assert upward_imports() == []


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a rank-side module that imports the driver is reported."""
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "bad.py").write_text("def f():\n    from tpspec.engine.llm_engine import LLMEngine\n")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "bad.py").write_text("from tpspec import spec_decode\n")
    assert upward_imports(tmp_path) == [
        "config/bad.py:1 (config) imports tpspec.spec_decode (spec_decode)",
        "worker/bad.py:2 (worker) imports tpspec.engine.llm_engine (engine)",
    ]


def test_no_source_file_passes_500_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in ROOT.rglob("*.py") if (n := p.read_text().count("\n")) > 500}
    assert long == {}, "split these by concept"
