"""The layers of the house (docs/architecture.md): app above services above the gyre runtime, held
by one import-linter `layers` contract with no ignores, and no import circle inside a package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="lint-imports is not installed")


def _copy_tree(dest: Path) -> None:
    for package in ("app", "services", "gyre"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=where,
        env={"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_layer_contract_has_no_ignores() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'type = "layers"' in text
    assert "ignore_imports" not in text


@pytest.mark.parametrize(
    ("probe", "importing"),
    [
        ("gyre/_probe.py", "import services.trainer.loop"),
        ("gyre/_probe.py", "import app.cli"),
        ("services/rollout/_probe.py", "import app.job.run"),
        ("services/rollout/_probe.py", "import services.trainer.config"),
    ],
)
def test_an_import_that_runs_back_up_breaks_the_contracts(tmp_path: Path, probe: str, importing: str) -> None:
    _copy_tree(tmp_path)
    clean = _lint(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    (tmp_path / probe).write_text(f'"""A probe that imports against the arrows."""\n\n{importing}\n')
    broken = _lint(tmp_path)
    assert broken.returncode != 0, f"{probe} doing `{importing}` was not caught:\n{broken.stdout}"
    assert "BROKEN" in broken.stdout


def _import_cycles_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_of_app_services_or_gyre_sits_in_an_import_circle() -> None:
    assert _import_cycles_module().import_cycles() == []


def test_the_circle_finder_sees_a_circle_of_two_modules() -> None:
    finder = _import_cycles_module()
    circles = finder._strongly_connected(["a", "b", "c"], {"a": ["b"], "b": ["a"], "c": ["a"]})
    assert [sorted(c) for c in circles if len(c) > 1] == [["a", "b"]]


MAX_LINES = 600


def test_no_python_file_outside_generated_code_and_tests_is_longer_than_600_lines() -> None:
    long_files = {}
    for package in ("app", "services", "gyre", "examples", "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts:  # generated protobuf/gRPC contracts
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long_files[str(path.relative_to(ROOT))] = lines
    assert long_files == {}, f"files over {MAX_LINES} lines: {long_files}"


def _string_imports(source: str) -> list[str]:
    """Module names passed as string literals to importlib.import_module / find_spec / __import__."""
    import ast

    names = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called not in {"import_module", "find_spec", "__import__"}:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.append(first.value)
        elif isinstance(first, ast.JoinedStr):  # f"services.{name}": its literal head names the package
            head = first.values[0] if first.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                names.append(head.value)
    return names


def test_no_module_reaches_another_layer_by_a_name_string_the_linter_cannot_see() -> None:
    hidden = []
    for package in ("app", "services", "gyre"):
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts[:2]:
                continue
            for name in _string_imports(path.read_text()):
                if name.split(".")[0] in {"app", "services", "gyre"} and name.split(".")[0] != package:
                    hidden.append(f"{path.relative_to(ROOT)}: {name}")
    assert hidden == []


def test_the_string_import_finder_sees_an_f_string_module_name() -> None:
    source = (
        'import importlib\nimportlib.util.find_spec(f"services.{name}")\nimportlib.import_module("app.x")\n'
    )
    assert _string_imports(source) == ["services.", "app.x"]
