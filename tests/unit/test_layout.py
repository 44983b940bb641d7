"""The package's boundaries (docs/DESIGN: only the engine adapter touches vLLM, only the service
layer the generated protobuf code) and the size of the engine's parts, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pyserver"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _sources() -> list[Path]:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20, sources
    return sources


def test_only_the_engine_adapter_imports_vllm() -> None:
    importers = {
        p.relative_to(PACKAGE).as_posix()
        for p in _sources()
        if any(n == "vllm" or n.startswith("vllm.") for n in _imports(p))
    }
    assert importers, "the adapter imports vllm somewhere"
    assert all(p.startswith("engine/adapter/") for p in importers), importers


def test_only_the_service_layer_imports_generated_protobuf_code() -> None:
    importers = {
        p.relative_to(PACKAGE).as_posix()
        for p in _sources()
        if any(n.endswith(("_pb2", "_pb2_grpc")) for n in _imports(p))
    }
    assert importers and all(p.startswith("service/") for p in importers), importers


def test_no_engine_module_is_over_400_lines() -> None:
    sizes = {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines())
        for p in (PACKAGE / "engine").rglob("*.py")
    }
    assert sizes and max(sizes.values()) <= 400, sizes


def test_every_pyserver_name_the_benchmarks_import_exists() -> None:
    """The benchmarks run for minutes before they reach a late import: a moved name must fail
    here, not half an hour into `make bench`."""
    import importlib

    checked = 0
    for script in sorted((PACKAGE.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyserver"):
                module = importlib.import_module(str(node.module))
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, (script.name, node.module, missing)
                checked += 1
    assert checked > 5
