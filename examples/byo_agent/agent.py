"""A small multi-turn, tool-calling agent written against the official `openai` client.

It knows nothing about Gyre: it reads its task as JSON on stdin, talks to whatever
OPENAI_BASE_URL / OPENAI_API_KEY point at (the `openai` client reads both), calls a calculator tool
when the model asks for one, and prints its final answer on the last line of stdout (also written
to answer.txt in its working directory). Like many real harnesses it shows the model only the
opening messages plus the last WINDOW messages, so once a conversation grows its prompts stop
extending each other and the history branches.

Run it by hand against any OpenAI-compatible server:

    echo '{"messages": [{"role": "user", "content": "What is 17 + 25?"}]}' | \
        OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python examples/byo_agent/agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from pathlib import Path

from openai import OpenAI

MAX_TURNS = 4  # model calls per task
WINDOW = 4  # messages kept after the opening ones
MAX_TOKENS = 12  # tokens per model call

SYSTEM = "You solve arithmetic tasks. Call the calculator tool to compute, then reply with the number only."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: + - * / on numbers only (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only numbers and + - * /")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"


def run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return "error: arguments are not JSON"
    return calculator(str(args.get("expression", ""))) if isinstance(args, dict) else "error: bad arguments"


def main() -> int:
    task = json.load(sys.stdin)
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("OPENAI_MODEL", "default")
    opening = [{"role": "system", "content": SYSTEM}, *task["messages"]]
    history: list[dict] = []
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=opening + history[-WINDOW:],
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
        )
        message = reply.choices[0].message
        turn: dict = {"role": "assistant", "content": message.content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            history.append(turn)
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                history.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        history.append(turn)
        answer = (message.content or "").strip()
        history.append(
            {"role": "user", "content": "Check it with the calculator; reply with the number only."}
        )
    Path("answer.txt").write_text(answer)
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
