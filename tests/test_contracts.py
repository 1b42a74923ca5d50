"""The contracts in proto/gyre/v1: generated stubs are current, and every field says what it means."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto" / "gyre" / "v1"
STUB_DIR = ROOT / "gyre" / "v1"

# A message field or map field: `[repeated|optional] type name = N [opts];` (enum values excluded below).
_FIELD = re.compile(
    r"^\s*(?:(?:repeated|optional)\s+)?(?:map\s*<[^>]+>|[A-Za-z_][\w.]*)\s+[A-Za-z_]\w*\s*=\s*\d+\s*(?:\[[^\]]*\])?\s*;"
)
_ENUM_VALUE = re.compile(r"^\s*[A-Z][A-Z0-9_]*\s*=\s*-?\d+")


def _load_gen_proto():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def uncommented_fields(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each field with neither a trailing `//` comment nor one on the line above."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not _FIELD.match(line) or _ENUM_VALUE.match(line) or "//" in line:
            continue
        if i > 0 and lines[i - 1].strip().startswith("//"):
            continue
        out.append((i + 1, line.strip()))
    return out


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    gen_proto = _load_gen_proto()
    gen_proto.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "gyre" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in STUB_DIR.iterdir() if p.is_file() and p.name in fresh}
    stale = sorted(name for name in fresh if committed.get(name) != fresh[name])
    assert not stale, f"stubs out of date: {stale}; run `python scripts/gen_proto.py` and commit gyre/v1"


@pytest.mark.parametrize("proto", sorted(p.name for p in PROTO_DIR.glob("*.proto")))
def test_every_proto_field_has_a_comment(proto: str) -> None:
    missing = uncommented_fields((PROTO_DIR / proto).read_text())
    listing = "\n".join(f"  {proto}:{n}: {line}" for n, line in missing)
    assert not missing, f"fields without a comment (unit, producer, consumer, meaning of absence):\n{listing}"


def test_the_comment_check_catches_a_bare_field() -> None:
    text = "message A {\n  // why\n  int32 a = 1;\n  int32 b = 2;  // unit\n  int32 c = 3;\n  enum K { K_X = 0; }\n}\n"
    assert uncommented_fields(text) == [(5, "int32 c = 3;")]
