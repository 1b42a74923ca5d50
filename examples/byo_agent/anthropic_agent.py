"""The example agent of agent.py, written against the official `anthropic` client instead.

It knows nothing about Gyre: it reads its task as JSON on stdin and talks to whatever
ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY point at (the `anthropic` client reads both; Gyre's external
harness sets them, and ANTHROPIC_AUTH_TOKEN, to one execution's endpoint). It calls a calculator
tool when the model asks for one, sends every reply back verbatim (its content blocks as they came),
prints its final answer on the last line of stdout (also written to answer.txt) and keeps a
transcript of what it sent and got (transcript.jsonl), as many harnesses do. Like agent.py it shows
the model only the opening message plus the last WINDOW messages.

Run it by hand against any Anthropic-compatible server:

    echo '{"messages": [{"role": "user", "content": "What is 17 + 25?"}]}' | \\
        ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_API_KEY=... python examples/byo_agent/anthropic_agent.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from agent import MAX_TOKENS, MAX_TURNS, SYSTEM, WINDOW, calculator
from anthropic import Anthropic

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    }
]


def run_tool(name: str, tool_input: dict[str, Any]) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    return calculator(str(tool_input.get("expression", "")))


def main() -> int:
    task = json.load(sys.stdin)
    client = Anthropic()  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
    model = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")
    opening = [
        {"role": m["role"], "content": m["content"]} for m in task["messages"] if m["role"] != "system"
    ]
    history: list[dict[str, Any]] = []
    answer = ""
    with Path("transcript.jsonl").open("w") as transcript:
        for _ in range(MAX_TURNS):
            request = {
                "model": model,
                "system": SYSTEM,
                "messages": opening + history[-WINDOW:],  # pairs: starts on an assistant turn
                "tools": TOOLS,
                "max_tokens": MAX_TOKENS,
            }
            reply = client.messages.create(**request)
            content = [block.model_dump(exclude_none=True) for block in reply.content]
            transcript.write(json.dumps({"request": request, "id": reply.id, "content": content}) + "\n")
            history.append({"role": "assistant", "content": content})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if uses:
                results = [
                    {"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, b.input)}
                    for b in uses
                ]
                history.append({"role": "user", "content": results})
                continue
            answer = "".join(block.text for block in reply.content if block.type == "text").strip()
            history.append(
                {"role": "user", "content": "Check it with the calculator; reply with the number only."}
            )
    Path("answer.txt").write_text(answer)
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
