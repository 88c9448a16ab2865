"""The seams between the three processes, read from the imports.

``kvd/common/`` is what the processes share; the daemon's own modules sit beside it.
A reader of ``inference/`` or ``gateway/`` knows that nothing there reaches into the
daemon, and the daemon never imports an engine or a gateway.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # ``from kvd import daemon`` names the module in the alias.
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def modules_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def reaches_daemon(module: str) -> bool:
    """A ``kvd`` module outside ``kvd.common`` (``kvd`` itself and ``kvd_api`` are fine)."""
    parts = module.split(".")
    return parts[0] == "kvd" and len(parts) > 1 and parts[1] != "common"


def is_process_package(module: str) -> bool:
    return module.split(".")[0] in ("inference", "gateway")


@pytest.mark.parametrize("folder", ["inference", "gateway"])
def test_engine_and_gateway_import_only_the_shared_part_of_kvd(folder):
    crossings = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in modules_under(folder)
        for module in imported_modules(path)
        if reaches_daemon(module)
    ]
    assert crossings == []


def test_the_shared_package_imports_no_daemon_module():
    crossings = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in modules_under("kvd/common")
        for module in imported_modules(path)
        if reaches_daemon(module) or is_process_package(module)
    ]
    assert crossings == []


def test_the_daemon_imports_no_engine_or_gateway():
    crossings = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in modules_under("kvd")
        for module in imported_modules(path)
        if is_process_package(module)
    ]
    assert crossings == []
