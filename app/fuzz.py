"""`gyre fuzz`: hypothesis-generated inputs against Gyre's edges, with real servers; counts crashes.

    gyre fuzz [--examples N] [--only NAME ...] [--json]

Targets (each gets N examples, default 10,000):

- `http.chat`, `http.completions`, `http.executions`, `http.end`: requests to the
  rollout's OpenAI-compatible endpoint over a real socket (uvicorn on port 0, one keep-alive
  connection), served by a real torch engine (a tiny model, so valid calls are cheap) whose steps
  go to a real nats-server (embedded, on a free port). Bodies mix arbitrary JSON, wrongly typed
  values under the real field names, near-valid requests and raw bytes; headers mix the right,
  wrong and missing keys and execution ids. A crash is a 5xx, a response that is not an OpenAI
  error body, or a transport error (e.g. a reset connection).
- `event.<Type>`: arbitrary bytes and mutated valid payloads decoded as each event type the bus
  carries (the consumers' `FromString`); a crash is any exception but `DecodeError`.
- `consumer.steps`: StepEvents (valid, mutated, extreme values) through the consumer checks
  (gyre.validation.step_problem, then the trajectory's `validate_step` for those it passes).
- `consumer.weights`: WeightsPublishedEvents through the rollout's `WeightSwapper.handle` (real
  router, a real weights store with one genuine file); a crash is an exception, and any accepted
  version whose file is outside the store is counted as `bad_accepted`.

Needs the dev extra (hypothesis). Good data lost (`good_lost`): successful model calls (HTTP 200) minus the StepEvents that reached the
steps stream on NATS; must be 0. Exit status 1 if any crash, bad acceptance or loss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
except ImportError as exc:  # a dev dependency
    raise ImportError("`gyre fuzz` needs hypothesis: pip install -e '.[dev]'") from exc

from gyre.errors import GyreError

API_KEY = "fuzz-api-key-0123456789"
ADMIN_KEY = "fuzz-admin-key-0123456789"
RUN_ID = "fuzz"


@dataclass
class TargetReport:
    """What one target saw: examples run, crashes, and outcome counts (HTTP status or result kind)."""

    examples: int = 0
    crashes: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    first_crash: str = ""

    def crash(self, what: str) -> None:
        self.crashes += 1
        if not self.first_crash:
            self.first_crash = what[-2000:]

    def as_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "crashes": self.crashes,
            "outcomes": dict(sorted(self.outcomes.items())),
            "first_crash": self.first_crash,
        }


def run_target(
    report: TargetReport, strategy: st.SearchStrategy[Any], check: Callable[[Any], None], n: int
) -> None:
    """Feed `n` hypothesis examples of `strategy` to `check`; its exceptions are counted as crashes."""

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],  # count every example; no shrinking of a crash (it is reported as is)
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(value: Any) -> None:
        report.examples += 1
        try:
            check(value)
        except Exception as exc:  # noqa: BLE001 - the point: count, keep going
            report.crash(f"{value!r:.500}\n{''.join(traceback.format_exception(exc))}")

    one()


# -- value strategies -----------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
ODD = JSON | st.sampled_from([10**30, -1, 0, 2**63, 1e308, "", "lots", [True, False], [1, 2], {"a": 1}, None])


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, chosen with the given integer weights (hypothesis' one_of is not weighted)."""
    return st.sampled_from([s for w, s in choices for _ in range(w)]).flatmap(lambda s: s)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` seven times in eight, else an odd value (wrong type, extreme, empty)."""
    return weighted((7, valid), (1, ODD))


MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "tool", "developer"]))},
    optional={
        "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2) | ODD,
        "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": st.text(max_size=8)})}), max_size=2) | ODD,
    },
)  # fmt: skip
SAMPLING = {
    "max_tokens": mostly(st.integers(1, 4)),
    "temperature": mostly(st.floats(0, 2)),
    "top_p": mostly(st.floats(0.01, 1)),
    "seed": mostly(st.integers(0, 2**31)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 600), max_size=3)),
    "user": st.sampled_from(["fz-a", "fz-b"]) | ODD,
    "metadata": st.fixed_dictionaries({}, optional={"execution_id": st.sampled_from(["fz-c", "fz-d"]) | ODD}) | ODD,
    "n": mostly(st.just(1)),
    "stream": mostly(st.just(False)),
    "logprobs": st.booleans() | st.integers(0, 3) | ODD,
}  # fmt: skip
CHAT = st.fixed_dictionaries(
    {"messages": mostly(st.lists(MESSAGE, min_size=1, max_size=3))},
    optional={**SAMPLING, "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}), max_size=2) | ODD},
)  # fmt: skip
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | st.lists(st.integers(0, 520), max_size=8) | st.lists(st.booleans(), max_size=3) | ODD},
    optional=SAMPLING,
)  # fmt: skip
END = st.fixed_dictionaries({}, optional={"kind": st.sampled_from(["finished", "truncated", "failed"]) | ODD, "reward": st.floats(-2, 2) | ODD, "error": st.text(max_size=20) | ODD})  # fmt: skip
ISSUE = st.fixed_dictionaries({}, optional={"task_id": st.sampled_from(["t-fz", "t/bad"]) | ODD, "group_id": ODD, "execution_id": ODD})  # fmt: skip
GOOD_KEY = st.one_of(
    st.just(f"Bearer {API_KEY}"), st.just(f"Bearer {API_KEY}"), st.just(f"Bearer {ADMIN_KEY}")
)
HEADERS = st.fixed_dictionaries(
    {
        "Authorization": st.sampled_from([f"Bearer {API_KEY}"] * 8 + [f"Bearer {ADMIN_KEY}"] * 2 + ["Bearer wrong", API_KEY, ""]),
        "X-Gyre-Execution-Id": st.sampled_from([f"fz-{c}" for c in "abcdefgh"] + ["bad id!", "x" * 200, ""]),
    },
    optional={"X-Gyre-Task-Id": st.sampled_from(["t-fz", "bad task", ""])},
)  # fmt: skip


def body_of(json_strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Request bodies: mostly JSON from `json_strategy`, some arbitrary JSON, some raw bytes."""
    structured = json_strategy.map(lambda v: json.dumps(v).encode())
    arbitrary = JSON.map(lambda v: json.dumps(v).encode())
    return weighted((6, structured), (1, arbitrary), (1, st.binary(max_size=64)))


# -- the HTTP stack ---------------------------------------------------------------------------------
class HttpStack:
    """A rollout endpoint (tiny torch engine, real NATS) served by uvicorn in a background thread."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-http", daemon=True)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self) -> str:
        from gyre.embedded import EmbeddedNats

        self.nats = EmbeddedNats(self.work / "nats")
        nats_url = self.nats.start()
        self.thread.start()
        return str(self.call(self._start(nats_url)))

    async def _start(self, nats_url: str) -> str:
        from gyre.bus import Bus
        from gyre.model import ModelConfig
        from services.rollout.engines.torch_engine import TorchEngine
        from services.rollout.openai import OpenAIEndpoint, create_app, serve
        from services.rollout.router import Router
        from services.rollout.steps import BusStepSink

        self.bus = await Bus.connect(nats_url, name="gyre-fuzz")
        await self.bus.ensure_streams()
        self.sink = BusStepSink(self.bus, max_buffer=1 << 16)
        self.sink.start()
        self.router = Router()
        model = ModelConfig.model_validate(
            {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
             "max_position_embeddings": 128}
        )  # fmt: skip
        engine = TorchEngine("fz0", "cpu0-0", model, init_seed=1)
        await engine.start()
        await self.router.add_engine(engine)
        self.endpoint = OpenAIEndpoint(
            self.router, self.sink, run_id=RUN_ID, api_key=API_KEY, admin_key=ADMIN_KEY, max_prompt_tokens=128
        )
        self.server, port = await serve(create_app(self.endpoint), "127.0.0.1", 0)
        return f"http://127.0.0.1:{port}"

    def steps_dead_lettered(self) -> int:
        """Steps the producer refused as invalid (gyre.validation) and sent to the dead-letter stream."""
        return int(self.sink.num_invalid)

    def steps_on_nats(self) -> int:
        async def count() -> int:
            await self.sink.flush()
            return await self.bus.num_stored("gyre.steps.>")

        return int(self.call(count()))

    def stop(self) -> None:
        async def stop() -> None:
            self.server.should_exit = True
            await self.server.gyre_task
            for device in list(self.router.engines):
                await self.router.remove_engine(device)
            await self.sink.close()
            await self.bus.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.nats.stop()


def http_check(
    client: Any, report: TargetReport, method: str, path: Callable[[Any], str], ok_count: list[int]
) -> Callable[[Any], None]:
    """A check that sends one request and counts its status; 5xx, non-error 4xx bodies and resets crash."""

    def check(example: Any) -> None:
        body, headers, extra = example
        response = client.request(
            method, path(extra), content=body, headers={"content-type": "application/json", **headers}
        )
        status = response.status_code
        report.outcomes[str(status)] += 1
        if status >= 500:
            raise AssertionError(f"HTTP {status}: {response.text[:500]}")
        if status >= 400 and "message" not in response.json().get("error", {}):
            raise AssertionError(f"HTTP {status} without an error message: {response.text[:500]}")
        if status == 200 and path(extra).endswith("completions"):
            ok_count[0] += 1

    return check


def fuzz_http(n: int, work: Path, reports: dict[str, TargetReport]) -> tuple[int, int]:
    """Run the HTTP targets; returns (good data lost: 200 model calls minus steps on NATS, steps the
    producer dead-lettered as invalid - a served call whose step is invalid is an endpoint bug)."""
    import httpx

    stack = HttpStack(work)
    base = stack.start()
    ok = [0]
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            ids = st.sampled_from(["fz-a", "fz-b", "fz-c", "nope", "bad id!"])
            targets: list[tuple[str, str, st.SearchStrategy[Any], Callable[[Any], str]]] = [
                ("http.chat", "POST", st.tuples(body_of(CHAT), HEADERS, st.none()), lambda _: "/v1/chat/completions"),
                ("http.completions", "POST", st.tuples(body_of(COMPLETION), HEADERS, st.none()), lambda _: "/v1/completions"),
                ("http.executions", "POST", st.tuples(body_of(ISSUE), HEADERS, st.none()), lambda _: "/gyre/executions"),
                ("http.end", "POST", st.tuples(body_of(END), HEADERS, ids), lambda e: f"/gyre/executions/{e}/end"),
            ]  # fmt: skip
            for name, method, strategy, path in targets:
                if name in reports:
                    run_target(
                        reports[name], strategy, http_check(client, reports[name], method, path, ok), n
                    )
        return ok[0] - stack.steps_on_nats(), stack.steps_dead_lettered()
    finally:
        stack.stop()


# -- event decoding and consumer checks ------------------------------------------------------------
def _valid_step() -> bytes:
    from gyre.v1 import events_pb2

    step = events_pb2.StepEvent(
        event_id="e.0", run_id=RUN_ID, task_id="t", group_id="g", execution_id="x", call_seq=0,
        prompt_token_ids=[257, 104, 261], completion_token_ids=[105, 258],
        completion_logprobs=[-0.5, -0.1], completion_versions=[0, 0],
    )  # fmt: skip
    return step.SerializeToString()


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """`seed` with a few bytes flipped, inserted or cut, plus arbitrary bytes."""

    def mutate(data: tuple[list[tuple[int, int]], int]) -> bytes:
        edits, cut = data
        out = bytearray(seed)
        for pos, value in edits:
            if out:
                out[pos % len(out)] = value
        return bytes(out[: max(0, len(out) - cut)])

    flips = st.tuples(
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4), st.integers(0, 8)
    )
    return st.one_of(flips.map(mutate), st.binary(max_size=256))


def fuzz_events(n: int, reports: dict[str, TargetReport]) -> None:
    from gyre.bus import subjects

    seed = _valid_step()
    for spec in subjects.STREAMS:
        name = f"event.{spec.msg_type.DESCRIPTOR.name}"
        if name not in reports:
            continue
        report = reports[name]

        def check(data: bytes, msg_type: Any = spec.msg_type, report: TargetReport = report) -> None:
            try:
                msg_type.FromString(data)
                report.outcomes["decoded"] += 1
            except DecodeError:
                report.outcomes["DecodeError"] += 1

        run_target(report, mutated(seed), check, n)


def step_strategy() -> st.SearchStrategy[Any]:
    from gyre.v1 import events_pb2

    ints = st.integers(-(2**31), 2**31 - 1)
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    ids = st.sampled_from(["", "x", "e-1"])
    structured = st.builds(
        lambda p, c, lp, v, seq, i: events_pb2.StepEvent(
            event_id="e", run_id=RUN_ID, task_id=i, group_id="g", execution_id=i, call_seq=seq,
            prompt_token_ids=p, completion_token_ids=c, completion_logprobs=lp, completion_versions=v,
        ),
        st.lists(st.integers(0, 600) | ints, max_size=6), st.lists(st.integers(0, 600) | ints, max_size=4),
        st.lists(st.floats(-5, 0) | floats, max_size=4), st.lists(st.integers(0, 3) | ints, max_size=4),
        st.integers(-2, 5), ids,
    )  # fmt: skip
    decoded = mutated(_valid_step()).map(lambda b: _try_decode(events_pb2.StepEvent, b))
    return structured | decoded.filter(lambda m: m is not None)


def _try_decode(msg_type: Any, data: bytes) -> Any:
    try:
        return msg_type.FromString(data)
    except DecodeError:
        return None


def fuzz_steps(n: int, report: TargetReport) -> None:
    from gyre.validation import step_problem
    from services.trajectory.ingest import validate_step

    def check(step: Any) -> None:
        problem = step_problem(step, vocab_size=512, latest_version=3, max_version_lead=1)
        if problem is not None:
            report.outcomes[f"refused:{problem.code}"] += 1
            return
        try:
            validate_step(step)
            report.outcomes["accepted"] += 1
        except GyreError as exc:
            report.outcomes[f"ingest:{type(exc).__name__}"] += 1

    run_target(report, step_strategy(), check, n)


def fuzz_weights(n: int, work: Path, report: TargetReport) -> int:
    """WeightsPublishedEvent batches through WeightSwapper.handle; returns versions accepted from outside the store."""
    import os

    from gyre.model import ModelConfig, build_model, save_weights
    from gyre.v1 import common_pb2, events_pb2
    from services.rollout.router import Router
    from services.rollout.weights import WeightSwapper

    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    outside = work / "outside.safetensors"
    genuine = store / "v000001.safetensors"
    sha = save_weights(build_model(ModelConfig.model_validate({}), seed=0), genuine)
    save_weights(build_model(ModelConfig.model_validate({}), seed=0), outside)
    uris = st.sampled_from([genuine.as_uri(), outside.as_uri(), f"file://{store}/../outside.safetensors",
                            "file:///etc/passwd", "http://x/y", f"file://{store}/%2e%2e/outside.safetensors", ""]) | st.text(max_size=20)  # fmt: skip
    weights = st.builds(
        lambda v, u, s: common_pb2.WeightVersion(version=v, uri=u, sha256=s),
        st.integers(1, 3) | st.integers(-(2**63), 2**63 - 1),
        uris,
        st.sampled_from([sha, "0" * 64, "", sha.upper()]) | st.text(max_size=64),
    )
    batches = st.lists(
        weights.map(lambda w: events_pb2.WeightsPublishedEvent(weights=w)), min_size=1, max_size=3
    )
    loop = asyncio.new_event_loop()
    bad = [0]
    root = os.path.realpath(store)

    def check(batch: list[Any]) -> None:
        swapper = WeightSwapper(Router(), store=store, max_version_ahead=10)
        loop.run_until_complete(swapper.handle(batch))
        if swapper.latest is not None:
            path = os.path.realpath(swapper.latest.uri.removeprefix("file://"))
            if not path.startswith(root + os.sep) or swapper.latest.sha256 != sha:
                bad[0] += 1
                report.crash(f"accepted {swapper.latest}")
            report.outcomes["accepted"] += 1
        for reason, count in swapper.refused.items():
            report.outcomes[f"refused:{reason}"] += count

    try:
        run_target(report, batches, check, n)
    finally:
        loop.close()
    return bad[0]


HTTP_TARGETS = ["http.chat", "http.completions", "http.executions", "http.end"]


def all_targets() -> list[str]:
    from gyre.bus import subjects

    events = [f"event.{s.msg_type.DESCRIPTOR.name}" for s in subjects.STREAMS]
    return [*HTTP_TARGETS, *events, "consumer.steps", "consumer.weights"]


def fuzz(n: int, only: list[str] | None = None) -> dict[str, Any]:
    """Run every target (or `only` those) with `n` examples each; the JSON-able summary."""
    names = only or all_targets()
    unknown = sorted(set(names) - set(all_targets()))
    if unknown:
        raise GyreError(f"unknown fuzz targets {unknown}; known: {all_targets()}")
    reports = {name: TargetReport() for name in names}
    started = time.perf_counter()
    good_lost = bad_accepted = dead_lettered = 0
    with tempfile.TemporaryDirectory(prefix="gyre-fuzz-") as tmp:
        work = Path(tmp)
        if any(name.startswith("http.") for name in names):
            good_lost, dead_lettered = fuzz_http(n, work, reports)
        fuzz_events(n, reports)
        if "consumer.steps" in reports:
            fuzz_steps(n, reports["consumer.steps"])
        if "consumer.weights" in reports:
            bad_accepted = fuzz_weights(n, work, reports["consumer.weights"])
    return {
        "examples_per_target": n,
        "targets": {name: r.as_dict() for name, r in reports.items()},
        "total_examples": sum(r.examples for r in reports.values()),
        "crashes": sum(r.crashes for r in reports.values()),
        "bad_accepted": bad_accepted,
        "good_lost": good_lost,
        "steps_dead_lettered": dead_lettered,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre fuzz", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--examples", type=int, default=10_000, help="examples per target (default 10,000)")
    parser.add_argument("--only", nargs="*", default=None, help="targets to run (default all)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples must be >= 1")
    import logging

    logging.basicConfig(level=logging.CRITICAL)  # refusals are logged by design; the summary counts them
    summary = fuzz(args.examples, args.only)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for name, r in summary["targets"].items():
            print(f"{name:<28} {r['examples']:>7} examples  {r['crashes']} crashes  {r['outcomes']}")
        print(
            f"crashes {summary['crashes']}  bad accepted {summary['bad_accepted']}  good lost {summary['good_lost']}"
        )
    return 1 if summary["crashes"] or summary["bad_accepted"] or summary["good_lost"] else 0
