"""The wire form of a StepEvent: compact prompts and parts (producer and consumer share this one module).

An execution of hundreds of calls repeats its history in every prompt; sent whole, a 1M-token
execution puts ~3 MB on the step stream per call. Rollout therefore sends each call *compact*:

    full step  (prompt P, completion C)                      what the agent / endpoint produced
      -> StepCompactor.compact: base = the execution's earlier published call (the latest of each of
         its agents is remembered) whose sequence S = its P + C shares the longest prefix with P;
         k = longest common prefix of P and S;   P  ==  S[:k] + P[k:]
         wire step: prompt_base_call_seq, prompt_base_len = k, prompt_token_ids = P[k:],
                    prompt_num_tokens = len(P), prompt_crc32 = crc32(P)     (the check)
      -> split: a step whose message would exceed the bound becomes num_parts messages whose token
         lists are consecutive slices (parts 0..n-1, published in order on the same subject)

Because the common prefix is taken with the previous prompt *and* completion, an ordinary turn
sends only the environment's reply, while compaction and stripped reasoning (a prompt that is not
an extension) send exactly the tokens that differ: nothing is approximated.

Consumers reverse it: `join_parts` (the bus consumer holds parts until all arrived), then
`rebuild_prompt` with the base call's sequence and `prompt_check` against the sent length and CRC.
Resume (services/rollout/resume.py) and the trajectory service both rebuild with these functions.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from gyre.v1 import events_pb2

StepEvent = events_pb2.StepEvent

# Default bound of one step message on the wire (bytes): a longer step is split into parts.
DEFAULT_STEP_MAX_BYTES = 1 << 20
# Worst-case bytes of one token in each list (varint int32 ids, float32 log-probs, varint int64
# versions, one more byte of slack each): a part holding this many tokens cannot exceed its bound.
_PROMPT_TOKEN_BYTES = 6
_COMPLETION_TOKEN_BYTES = 6 + 4 + 11
_TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_versions")


def token_crc32(tokens: np.ndarray | Sequence[int], value: int = 0) -> int:
    """CRC-32 (zlib) of token ids as little-endian int32: the check of a rebuilt prompt. `value`: the
    CRC of the tokens before these (zlib's running value), so a CRC can be extended piece by piece."""
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4"))
    return zlib.crc32(arr.data.cast("B"), value)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (one vectorised comparison)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class StepCompactor:
    """Producer side: turns each full step into its compact form against an earlier published call of
    the same execution, remembering the latest call of each of its agents (prompt + completion,
    int32: 4 bytes a token).

    The base is, among those remembered calls before the step, the one sharing the longest prefix
    with its prompt: a main agent's call after a sub-agent ran (the sub-agent's calls came last, in
    their own context) still sends only its new turn, not its whole history again. At most
    `max_agents` agents are remembered per execution (the most recently used).

    One per step publisher, fed in publication order. A step with no remembered call before it
    (parallel calls finishing out of order) is sent whole; it is then remembered if it is its agent's
    newest. `forget` drops an execution (its end)."""

    def __init__(self, max_executions: int = 100_000, max_agents: int = 4) -> None:
        # execution id -> agent id -> (call_seq, sequence) of the agent's latest published call
        self._last: OrderedDict[str, OrderedDict[str, tuple[int, np.ndarray]]] = OrderedDict()
        self._max_executions = max_executions
        self._max_agents = max_agents

    def __len__(self) -> int:
        return len(self._last)

    def remember(self, step: StepEvent) -> None:
        """Note `step` (full prompt) as its agent's latest call, e.g. the last call a resumed
        execution replayed, so that its next call is sent compact."""
        seq = np.concatenate(
            [
                np.asarray(step.prompt_token_ids, dtype=np.int32),
                np.asarray(step.completion_token_ids, dtype=np.int32),
            ]
        )
        self._note(step, seq)

    def _note(self, step: StepEvent, seq: np.ndarray) -> None:
        agents = self._last.setdefault(step.execution_id, OrderedDict())
        last = agents.get(step.agent_id)
        if last is not None and last[0] >= step.call_seq:
            return  # an older call of this agent finishing late: keep the newer one
        agents[step.agent_id] = (step.call_seq, seq)
        agents.move_to_end(step.agent_id)
        while len(agents) > self._max_agents:
            agents.popitem(last=False)
        self._last.move_to_end(step.execution_id)
        while len(self._last) > self._max_executions:
            self._last.popitem(last=False)

    def forget(self, execution_id: str) -> None:
        self._last.pop(execution_id, None)

    def compact(self, step: StepEvent) -> StepEvent:
        """`step` (full prompt) on the wire: a new message with a compact prompt where an earlier call
        shares a prefix with it, else a copy of it. Remembers `step` as its agent's latest call."""
        prompt = np.asarray(step.prompt_token_ids, dtype=np.int32)
        out = StepEvent()
        out.CopyFrom(step)
        best: tuple[int, int] | None = None  # (k, base call_seq)
        if not step.HasField("prompt_base_call_seq"):
            for seq_no, sequence in self._last.get(step.execution_id, {}).values():
                if seq_no < step.call_seq:
                    k = common_prefix_len(sequence, prompt)
                    if best is None or k > best[0] or (k == best[0] and seq_no > best[1]):
                        best = (k, seq_no)
        if best is not None:
            k, base = best
            if k == len(prompt) and not len(step.completion_token_ids):
                k -= 1  # keep one token: a step must carry some
            if k > 0:
                out.prompt_base_call_seq = base
                out.prompt_base_len = k
                del out.prompt_token_ids[:]
                out.prompt_token_ids.extend(prompt[k:].tolist())
                out.prompt_num_tokens = len(prompt)
                out.prompt_crc32 = token_crc32(prompt)
        self._note(step, np.concatenate([prompt, np.asarray(step.completion_token_ids, dtype=np.int32)]))
        return out


def rebuild_prompt(step: StepEvent, base_sequence: np.ndarray | Sequence[int]) -> np.ndarray:
    """The full prompt of a compact `step`, given its base call's whole sequence (prompt + completion)."""
    head = np.asarray(base_sequence, dtype=np.int32)[: step.prompt_base_len]
    return np.concatenate([head, np.asarray(step.prompt_token_ids, dtype=np.int32)])


def reference_problem(step: StepEvent, base_total_len: int | None) -> str | None:
    """Why `step`'s compact reference cannot be resolved against a base call of `base_total_len` tokens
    (None: not stored), or None if it can. A full step (no reference) never has a problem."""
    if not step.HasField("prompt_base_call_seq"):
        return None
    where = f"step {step.execution_id}.{step.call_seq}"
    if step.prompt_base_call_seq >= step.call_seq or step.prompt_base_call_seq < 0:
        return f"{where}: prompt_base_call_seq {step.prompt_base_call_seq} is not an earlier call"
    if base_total_len is None:
        return f"{where}: base call {step.execution_id}.{step.prompt_base_call_seq} is not stored"
    if not 0 <= step.prompt_base_len <= base_total_len:
        return (
            f"{where}: prompt_base_len {step.prompt_base_len} must lie in [0, {base_total_len}] "
            f"(the base call's tokens)"
        )
    return None


def prompt_check(step: StepEvent, prompt: np.ndarray) -> str | None:
    """Why the rebuilt `prompt` of a compact step differs from what the producer sent (its length and
    CRC-32), or None when it matches or the step carries no check."""
    if step.prompt_num_tokens <= 0 or len(prompt) != step.prompt_num_tokens:
        return prompt_sum_problem(step, len(prompt), 0)
    return prompt_sum_problem(step, len(prompt), token_crc32(prompt))


def prompt_sum_problem(step: StepEvent, num_tokens: int, crc: int) -> str | None:
    """`prompt_check` given the rebuilt prompt's length and CRC-32 only (a consumer that keeps running
    CRCs of its sequences checks a compact prompt without rebuilding it)."""
    if step.prompt_num_tokens <= 0:
        return None
    where = f"step {step.execution_id}.{step.call_seq}"
    if num_tokens != step.prompt_num_tokens:
        return f"{where}: rebuilt prompt has {num_tokens} tokens, the producer sent {step.prompt_num_tokens}"
    if crc != step.prompt_crc32:
        return f"{where}: rebuilt prompt's CRC-32 {crc:#010x} differs from the producer's {step.prompt_crc32:#010x}"
    return None


# ---------------------------------------------------------------------------------------- parts
def part_key(step: StepEvent) -> tuple[str, int, int] | None:
    """(key shared by the parts of one publication, part_index, num_parts) of a part; None for a whole step."""
    if step.num_parts <= 1:
        return None
    return (f"{step.event_id}@{step.finished_unix_s!r}/{step.num_parts}", step.part_index, step.num_parts)


def split_step(step: StepEvent, max_bytes: int) -> list[StepEvent]:
    """`step` as messages of at most `max_bytes` each: itself when it fits, else parts whose token lists
    are consecutive slices (join_parts reverses it). ValueError if even one token per part cannot fit
    (its other fields alone are too large)."""
    if step.ByteSize() <= max_bytes:
        return [step]
    head = StepEvent()
    head.CopyFrom(step)
    for name in _TOKEN_FIELDS:
        head.ClearField(name)  # type: ignore[arg-type]
    head.num_parts, head.part_index = 1 << 20, 1 << 20  # their largest varint size
    room = max_bytes - head.ByteSize() - 4 * 8  # four length-delimited field headers
    if room < _COMPLETION_TOKEN_BYTES:
        raise ValueError(
            f"step {step.event_id}: {head.ByteSize()} bytes without its tokens, more than the bound of {max_bytes}"
        )
    prompt, completion = len(step.prompt_token_ids), len(step.completion_token_ids)
    per_prompt_part = room // _PROMPT_TOKEN_BYTES
    # Cut points: prompt first, then completion; each part fills its room by worst-case token sizes.
    cuts: list[tuple[int, int, int, int]] = []  # (prompt from, to, completion from, to)
    p = c = 0
    while p < prompt or c < completion or not cuts:
        left = room
        p_end = min(prompt, p + per_prompt_part)
        left -= (p_end - p) * _PROMPT_TOKEN_BYTES
        c_end = min(completion, c + left // _COMPLETION_TOKEN_BYTES)
        cuts.append((p, p_end, c, c_end))
        p, c = p_end, c_end
    parts: list[StepEvent] = []
    for i, (p0, p1, c0, c1) in enumerate(cuts):
        part = StepEvent()
        part.CopyFrom(head)
        part.part_index, part.num_parts = i, len(cuts)
        part.prompt_token_ids.extend(step.prompt_token_ids[p0:p1])
        part.completion_token_ids.extend(step.completion_token_ids[c0:c1])
        part.completion_logprobs.extend(step.completion_logprobs[c0:c1])
        part.completion_versions.extend(step.completion_versions[c0:c1])
        parts.append(part)
    return parts


def join_parts(parts: Sequence[StepEvent]) -> StepEvent:
    """The step whose parts are `parts` (any order; all of one publication): metadata of part 0, token
    lists concatenated in part order, part fields cleared. ValueError if parts are missing or mixed."""
    ordered = sorted(parts, key=lambda s: s.part_index)
    n = ordered[0].num_parts
    keys = {(s.event_id, s.finished_unix_s, s.num_parts) for s in ordered}
    if [s.part_index for s in ordered] != list(range(n)) or len(keys) != 1:
        raise ValueError(
            f"step {ordered[0].event_id}: parts {[s.part_index for s in ordered]} of {n} do not form one step"
        )
    out = StepEvent()
    out.CopyFrom(ordered[0])
    out.ClearField("part_index")
    out.ClearField("num_parts")
    for s in ordered[1:]:
        out.prompt_token_ids.extend(s.prompt_token_ids)
        out.completion_token_ids.extend(s.completion_token_ids)
        out.completion_logprobs.extend(s.completion_logprobs)
        out.completion_versions.extend(s.completion_versions)
    return out


def join_stored_parts(steps: Sequence[StepEvent]) -> list[StepEvent]:
    """Whole steps of `steps` in their order (parts joined at the position of their last part; an
    incomplete publication left out): for readers of the stored stream such as resume."""
    out: list[StepEvent] = []
    held: dict[str, dict[int, StepEvent]] = {}
    for s in steps:
        key = part_key(s)
        if key is None:
            out.append(s)
            continue
        group = held.setdefault(key[0], {})
        group[key[1]] = s
        if len(group) == key[2]:
            out.append(join_parts(list(held.pop(key[0]).values())))
    return out


class StepParts:
    """The bus consumer's view of StepEvent parts (gyre.bus.consumer.Parts)."""

    def key(self, msg: StepEvent) -> tuple[str, int, int] | None:
        return part_key(msg)

    def join(self, parts: list[StepEvent]) -> StepEvent:
        return join_parts(parts)


STEP_PARTS = StepParts()
