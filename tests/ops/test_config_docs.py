"""docs/configuration.md is generated from the config models and must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_matches_the_config_models() -> None:
    expected = _generator().render()
    actual = (ROOT / "docs" / "configuration.md").read_text()
    assert actual == expected, "docs/configuration.md is stale: run `python scripts/gen_config_docs.py`"


def test_every_documented_field_has_a_description() -> None:
    text = _generator().render()
    assert "(undocumented)" not in text
    assert "| `run_id` |" in text and "| `services` |" in text
