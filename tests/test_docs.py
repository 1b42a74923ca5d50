"""Docs that cannot drift: every doc, file, module and function that the docs and module docstrings
cite exists.

What is checked, in docs/*.md, README.md and the module docstring of every module under gyre/,
services/, scripts/ and examples/:

- a cited doc (``docs/x.md``, or a relative markdown link ``](x.md)``) exists;
- a cited path with a directory (``services/trajectory/core.py``, ``proto/gyre/v1/x.proto``) exists,
  from the repository root, from the citing file's directory, or as the tail of a file in the
  repository (``engines/sampling.py`` inside a section about services/rollout/);
- a cited bare Python file name in backquotes (`` `tree.py` ``) is the name of a file in the repository;
- a cited dotted name in backquotes that starts with a top-level package (``gyre.``, ``services.``)
  imports and resolves attribute by attribute (a pydantic field or dataclass field counts);
- in a module docstring, a backquoted ``Name.attr`` or ``name()`` whose first name is defined
  in that module resolves in that module.

Runtime outputs (``runs/...``, absolute paths, URLs) are not repository files and are skipped.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gyre", "services", "scripts", "examples")
SUFFIXES = "py|proto|md|yaml|yml|toml|json|sh|cfg|ini|txt"

_DOC_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
_DOCS_PATH = re.compile(r"(?<![\w./-])((?:\.\./)?docs/[\w.-]+\.md)")
_PATH = re.compile(rf"(?<![\w./:-])((?:\.\./)?[\w.-]+(?:/[\w.-]+)+\.(?:{SUFFIXES}))(?![\w/])")
_BARE_PY = re.compile(r"`([\w-]+\.py)`")
_DOTTED = re.compile(r"`((?:gyre|services|scripts|examples)(?:\.\w+)+)(?:\(\))?`")
_LOCAL = re.compile(r"`([A-Za-z_]\w*)(?:\.(\w+))?(\()?")
_SKIP_PREFIXES = ("runs/", "run_dir/", "path/to/", "/", "~")


@cache
def repo_files() -> tuple[str, ...]:
    """Files tracked or not yet tracked (but not ignored) by git, relative to the root."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return tuple(f for f in out if f and (ROOT / f).exists())


def _exists(cited: str, source: Path) -> bool:
    if cited.startswith(_SKIP_PREFIXES):
        return True
    if (ROOT / cited).exists() or (source.parent / cited).resolve().exists():
        return True
    tail = "/" + cited.lstrip("./")
    return any(("/" + f).endswith(tail) for f in repo_files())


def _module_docstrings() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for f in repo_files():
        if f.endswith(".py") and f.split("/")[0] in PACKAGES and not f.startswith("gyre/v1/"):
            path = ROOT / f
            tree = ast.parse(path.read_text(), filename=f)
            doc = ast.get_docstring(tree)
            if doc:
                out.append((path, doc, tree))
    return out


def _markdown() -> list[tuple[Path, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(p, p.read_text()) for p in files]


def _strip_urls(text: str) -> str:
    return re.sub(r"https?://\S+", "", text)


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            fields = {
                **getattr(obj, "model_fields", {}),
                **getattr(obj, "__dataclass_fields__", {}),
                **getattr(obj, "__annotations__", {}),
            }
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif attr in fields:
                return True
            else:
                return False
        return True
    return False


def citation_errors(source: Path, text: str, module: ast.Module | None = None) -> list[str]:
    """Every citation in ``text`` (from ``source``) that does not resolve, as 'file: what'."""
    rel = source.relative_to(ROOT)
    text = _strip_urls(text)
    errors: list[str] = []
    paths = set(_DOCS_PATH.findall(text)) | set(_DOC_LINK.findall(text)) | set(_PATH.findall(text))
    for cited in sorted(paths):
        if not _exists(cited, source):
            errors.append(f"{rel}: cites {cited}, which does not exist")
    if source.suffix == ".md":  # in code, a bare name often means a file of a user's workspace
        for cited in sorted(set(_BARE_PY.findall(text))):
            if not any(f.rsplit("/", 1)[-1] == cited for f in repo_files()):
                errors.append(f"{rel}: cites {cited}, and no file of that name exists")
    for cited in sorted(set(_DOTTED.findall(text))):
        if not _resolve_dotted(cited):
            errors.append(f"{rel}: cites {cited}, which does not resolve")
    if module is not None:
        defined = _top_level_names(module)
        for name, attr, call in set(_LOCAL.findall(text)):
            if name in defined and attr and not _has_member(module, name, attr):
                errors.append(f"{rel}: cites {name}.{attr}, but {name} has no {attr}")
            elif call and not attr and name not in defined and _looks_like_our_function(name):
                errors.append(
                    f"{rel}: cites {name}(), which is defined neither here nor anywhere in the code"
                )
    return errors


def _top_level_names(module: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = node
    return names


def _has_member(module: ast.Module, name: str, attr: str) -> bool:
    node = _top_level_names(module)[name]
    if not isinstance(node, ast.ClassDef):
        return True  # an imported or assigned name: not resolved statically here
    for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and sub.name == attr:
            return True
        if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name) and sub.target.id == attr:
            return True
        if isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in sub.targets):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == attr:
            return True  # self.attr = ...
    return bool(node.bases)  # inherited members are not followed; a class with bases may have it


@cache
def _all_defined_names() -> frozenset[str]:
    names: set[str] = set()
    for f in repo_files():
        if f.endswith(".py"):
            for node in ast.walk(ast.parse((ROOT / f).read_text(), filename=f)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
    return frozenset(names)


def _looks_like_our_function(name: str) -> bool:
    """A snake_case name with an underscore (``score_group``), not a builtin or a library call."""
    return "_" in name.strip("_") and name not in _all_defined_names()


MARKDOWN = _markdown()
DOCSTRINGS = _module_docstrings()


def test_the_architecture_page_exists_and_every_service_package_points_to_it() -> None:
    assert (ROOT / "docs" / "architecture.md").is_file()
    for init in sorted((ROOT / "services").glob("*/__init__.py")):
        assert "docs/architecture.md" in init.read_text(), init


@pytest.mark.parametrize("path,text", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p, _ in MARKDOWN])
def test_every_citation_in_a_doc_exists(path: Path, text: str) -> None:
    assert citation_errors(path, text) == []


def test_every_citation_in_a_module_docstring_exists() -> None:
    errors = [e for path, doc, tree in DOCSTRINGS for e in citation_errors(path, doc, tree)]
    assert errors == []


def test_every_doc_and_path_cited_in_code_comments_and_docstrings_exists() -> None:
    """Beyond module docstrings: every docstring and comment of the code (not the tests, whose
    inputs name missing things on purpose)."""
    errors = []
    for f in repo_files():
        if f.endswith(".py") and f.split("/")[0] in PACKAGES and not f.startswith("gyre/v1/"):
            path = ROOT / f
            errors += citation_errors(path, _docstrings_and_comments(path.read_text()))
    assert errors == []


def _docstrings_and_comments(source: str) -> str:
    parts = [c.group(1) for c in re.finditer(r"#(.*)$", source, flags=re.M)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def test_the_checker_catches_a_missing_doc_file_module_and_method(tmp_path: Path) -> None:
    source = ROOT / "docs" / "architecture.md"
    text = (
        "See docs/nowhere.md and [x](gone.md), services/trajectory/nothing.py, `nothing_here.py`, "
        "`services.trajectory.core.NoSuchThing` and `gyre.no_module.x`."
    )
    errors = citation_errors(source, text)
    assert len(errors) == 6, errors
    assert citation_errors(ROOT / "gyre" / "x.py", "a `pytest.py` of the user's workspace") == []
    module = ast.parse("class Policy:\n    def plan(self): ...\n")
    assert citation_errors(source, "`Policy.plan` is fine", module) == []
    assert len(citation_errors(source, "`Policy.replan(snapshot)` is not", module)) == 1
    assert len(citation_errors(source, "`missing_helper()` is not", module)) == 1


def test_the_checker_accepts_what_exists() -> None:
    source = ROOT / "README.md"
    text = (
        "docs/trajectory.md, [t](docs/trajectory.md), services/trajectory/core.py, engines/torch_engine.py, "
        "`tree.py`, `services.trajectory.config.TrajectoryConfig.max_batch_tokens`, runs/x/events.json, "
        "https://example.com/a/b.py"
    )
    assert citation_errors(source, text) == []


def _docs_numbers():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("docs_numbers", ROOT / "scripts" / "docs_numbers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_bench_figure_in_the_docs_is_the_rendered_output_of_its_command() -> None:
    """A docs-numbers block must equal what scripts/docs_numbers.py renders from the recorded JSON
    output of its bench (docs/numbers/<name>.json); hand edits between the markers fail here."""
    dn = _docs_numbers()
    for name, (_, _, doc) in dn.BENCHES.items():
        block = dn.block_in(doc, name)
        assert block is not None, f"{doc.relative_to(ROOT)} lost its docs-numbers markers for {name}"
        record = dn.NUMBERS / f"{name}.json"
        assert record.is_file(), f"{record.relative_to(ROOT)} missing: run `make docs-numbers`"
        assert block == dn.render_block(name, json.loads(record.read_text())), (
            f"{doc.relative_to(ROOT)} ({name}) differs from its JSON: run `make docs-numbers`"
        )
