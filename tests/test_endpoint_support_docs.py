"""The endpoint's support table (docs/rollout.md) agrees with the README's feature line and with
the request models: what the table says is supported is a field the endpoint takes and does not
refuse; what it says is not supported is a field the endpoint refuses with a 400 (schema.UNSUPPORTED)."""

from __future__ import annotations

import re
from pathlib import Path

from services.rollout.openai.routes import model_routes
from services.rollout.openai.schema import UNSUPPORTED, ChatRequest, CompletionRequest, StreamOptions

ROOT = Path(__file__).resolve().parents[1]
ROUTES = {"messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}


def _table() -> dict[str, str]:
    text = (ROOT / "docs" / "rollout.md").read_text()
    block = text.split("<!-- endpoint-support -->", 1)[1].split("<!-- /endpoint-support -->", 1)[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[-1]
    return rows


def _readme() -> dict[str, str]:
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "Endpoint support:" in x)
    out = {}
    for level, names in re.findall(r"(yes|partial|no): ((?:`[^`]+`(?:, )?)+)", line):
        out.update({name: level for name in re.findall(r"`([^`]+)`", names)})
    return out


def test_the_readme_and_the_docs_table_agree() -> None:
    table = _table()
    assert table and set(table.values()) <= {"yes", "no", "partial"}
    assert _readme() == table
    for name in ("stream", "n", "stop"):  # what the README has long said, and the code does
        assert table[name] == "yes"


def test_the_table_agrees_with_the_request_models() -> None:
    fields = (
        set(ChatRequest.model_fields) | set(CompletionRequest.model_fields) | set(StreamOptions.model_fields)
    )
    refused = {name for name, _, _ in UNSUPPORTED}
    routes = {str(getattr(r, "path", "")) for r in model_routes.routes}
    for name, level in _table().items():
        if name in ROUTES:
            assert ROUTES[name] in routes and level == "yes", name
            continue
        assert name in fields, f"{name} is not a field of the request models"
        assert (name in refused) == (level in ("no", "partial")), name
    assert refused <= set(_table()), f"refused fields missing from the table: {refused - set(_table())}"
