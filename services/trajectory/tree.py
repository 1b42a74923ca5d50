"""Radix tree of token segments: one tree per task, every LLM call of every execution inserted.

An LLM call is the token sequence ``prompt + completion``. It is inserted where its tokens leave
the tree: the longest common token prefix with what is stored is shared, a node is split where
the call diverges inside it, and the rest becomes a new branch. Calls of every execution of the
same task (all group members, every sub-agent) go into the same tree; sequences that share no
first token become separate roots.

Guarantees
- Lossless: every call is recorded as (end node, prompt length) plus its own completion log-probs
  and versions, so ``export_call`` gives back the exact prompt ids, completion ids, log-probs and
  versions (see ``CallRecord``). A call always ends on a node boundary (the tree splits there).
- Order-independent: the set of root-to-node token sequences does not depend on the order in
  which calls arrive, so out-of-order delivery builds the same tree (node ids may differ).
- Node ids are stable under splits: splitting node N at k creates a new *upper* node for
  ``N[:k]`` and N keeps its id for the lower part, so any call ending at N still ends at N.
- Fast: comparisons are numpy operations per node, never Python loops per token.

Which tokens are trained ("trained once, as generated"): a token is trained for an execution
only where that execution generated it, i.e. inside the completion span of one of its calls. A
token generated in call c and repeated as prompt in call c+1 lies on the *same* tree position
when the history extends as a prefix, so it is trained once; when the later prompt is rewritten
(compaction, stripped reasoning) the copy sits on another branch as a prompt token and is not
trained there. ``owned_positions`` computes that set per execution.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from gyre.errors import InvalidArgument

TOKEN_DTYPE = np.int32
LOGPROB_DTYPE = np.float32
VERSION_DTYPE = np.int64


class Node:
    """A segment of tokens; its first token sits at position ``start`` of every sequence through it."""

    __slots__ = ("node_id", "parent", "tokens", "start", "children", "num_call_ends", "crc_end")

    def __init__(self, node_id: int, parent: Node | None, tokens: np.ndarray, start: int) -> None:
        self.node_id = node_id
        self.parent = parent
        self.tokens = tokens
        self.start = start
        self.children: dict[int, Node] = {}
        self.num_call_ends = 0  # calls (of any execution) whose sequence ends exactly here
        # CRC-32 of every token from the root to this node's end (gyre.bus.steps.token_crc32), computed
        # when first asked for (`path_crc32`); a split leaves the lower part's value valid.
        self.crc_end: int | None = None

    @property
    def end(self) -> int:
        """Position one past this node's last token (= length of every sequence ending here)."""
        return self.start + len(self.tokens)

    @property
    def depth_nodes(self) -> int:
        d, n = 0, self.parent
        while n is not None and n.node_id >= 0:
            d, n = d + 1, n.parent
        return d

    def path(self) -> list[Node]:
        """Nodes from the root down to (and including) this node."""
        out: list[Node] = []
        n: Node | None = self
        while n is not None and n.node_id >= 0:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def segment_hash(self) -> bytes:
        return hashlib.blake2b(self.tokens.tobytes(), digest_size=16).digest()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Node({self.node_id}, start={self.start}, len={len(self.tokens)})"


_NO_TOKENS = np.zeros(0, dtype=TOKEN_DTYPE)


def _crc(tokens: np.ndarray, value: int) -> int:
    return zlib.crc32(np.ascontiguousarray(tokens, dtype="<i4").data.cast("B"), value)


def path_crc32(node: Node) -> int:
    """CRC-32 of the sequence from the root to the end of `node` (as `gyre.bus.steps.token_crc32`).

    Kept per node once computed, so the CRC of a path that grows by a call costs the new tokens only."""
    pending: list[Node] = []
    n: Node | None = node
    while n is not None and n.node_id >= 0 and n.crc_end is None:
        pending.append(n)
        n = n.parent
    value = n.crc_end if n is not None and n.node_id >= 0 and n.crc_end is not None else 0
    for p in reversed(pending):
        value = p.crc_end = _crc(p.tokens, value)
    return value


def locate(node: Node, k: int) -> tuple[Node, Node | None]:
    """On the path from the root to `node` (whose end is at least `k`): the deepest node ending at or
    before position `k` (the virtual root if none), and the next node on the path (None when the
    first one is `node` itself). Walks up from `node`: as many steps as nodes end after `k`."""
    after: Node | None = None
    n = node
    while n.node_id >= 0 and n.end > k:
        assert n.parent is not None
        after, n = n, n.parent
    return n, after


def prefix_crc32(node: Node, k: int) -> int:
    """CRC-32 of the first `k` tokens of the sequence ending at `node` (k <= node.end): the kept CRC
    of the path above plus the tokens of one node."""
    upper, after = locate(node, k)
    value = path_crc32(upper) if upper.node_id >= 0 else 0
    if after is not None and k > after.start:
        value = _crc(after.tokens[: k - after.start], value)
    return value


@dataclass(slots=True)
class CallRecord:
    """One stored LLM call: where it ends in the tree and its own generation data."""

    execution_id: str
    call_seq: int
    end_node: Node
    prompt_len: int
    completion_logprobs: np.ndarray  # float32, one per completion token
    completion_versions: np.ndarray  # int64, one per completion token
    agent_id: str = "main"

    @property
    def total_len(self) -> int:
        return self.end_node.end

    @property
    def completion_len(self) -> int:
        return self.total_len - self.prompt_len


@dataclass(slots=True)
class ExportedCall:
    """A call rebuilt from the tree: exactly what the engine saw and produced."""

    call_seq: int
    prompt_token_ids: np.ndarray
    completion_token_ids: np.ndarray
    completion_logprobs: np.ndarray
    completion_versions: np.ndarray
    agent_id: str


@dataclass(slots=True)
class TreeChanges:
    """What an insert changed, for persistence: new nodes and nodes whose segment/parent changed."""

    created: list[Node] = field(default_factory=list)
    modified: list[Node] = field(default_factory=list)

    def extend(self, other: TreeChanges) -> None:
        self.created.extend(other.created)
        self.modified.extend(other.modified)


class NodeIds:
    """Allocator of node ids, unique across every tree of a process (and of a run once persisted)."""

    def __init__(self, next_id: int = 1) -> None:
        self.next_id = next_id

    def take(self) -> int:
        nid = self.next_id
        self.next_id += 1
        return nid


class TaskTree:
    """The radix tree of one task. Not thread-safe: callers serialise inserts."""

    def __init__(self, task_id: str, ids: NodeIds | None = None) -> None:
        self.task_id = task_id
        self.ids = ids or NodeIds()
        self.root = Node(-1, None, np.zeros(0, dtype=TOKEN_DTYPE), 0)  # virtual, never stored
        self.nodes: dict[int, Node] = {}
        self.calls: dict[tuple[str, int], CallRecord] = {}
        self.calls_by_execution: dict[str, dict[int, CallRecord]] = {}

    # ----------------------------------------------------------------- building
    def insert_sequence(
        self,
        seq: np.ndarray,
        changes: TreeChanges | None = None,
        known_prefix: tuple[Node, int] | None = None,
    ) -> Node:
        """Insert a token sequence; return the node it ends at (splitting one if needed).

        ``known_prefix=(node, k)`` promises that ``seq[:k]`` equals the first k tokens of the
        sequence ending at ``node`` (a compact step names its base call): those tokens are not
        compared again, the walk starts at the deepest ancestor that ends within them.
        """
        if len(seq) == 0:
            raise InvalidArgument(
                "cannot insert an empty token sequence: a call needs prompt or completion tokens"
            )
        changes = changes if changes is not None else TreeChanges()
        node, pos = self.root, 0
        if known_prefix is not None:
            node, _ = locate(known_prefix[0], min(known_prefix[1], len(seq)))
            pos = node.end if node.node_id >= 0 else 0
        return self._descend(node, pos, seq[pos:], changes)

    def _descend(self, node: Node, pos: int, rest: np.ndarray, changes: TreeChanges) -> Node:
        """Insert `rest`, the tokens from position `pos` on of a sequence whose first `pos` tokens are
        the path to `node` (which ends at `pos`); return the node the sequence ends at."""
        i, n = 0, len(rest)
        while i < n:
            child = node.children.get(int(rest[i]))
            if child is None:
                new = Node(self.ids.take(), node, rest[i:].copy(), pos + i)
                node.children[int(rest[i])] = new
                self.nodes[new.node_id] = new
                changes.created.append(new)
                return new
            seg = child.tokens
            m = min(len(seg), n - i)
            a, b = seg[:m], rest[i : i + m]
            k = m if np.array_equal(a, b) else int(np.argmax(a != b))
            if k == len(seg):
                node, i = child, i + k
                continue
            node = self._split(child, k, changes)
            i += k
        return node

    def _split(self, child: Node, k: int, changes: TreeChanges) -> Node:
        """Split ``child`` after its k-th token; the new upper node takes child's place."""
        assert 0 < k < len(child.tokens)
        parent = child.parent
        assert parent is not None
        upper = Node(self.ids.take(), parent, child.tokens[:k].copy(), child.start)
        parent.children[int(child.tokens[0])] = upper
        child.tokens = child.tokens[k:].copy()
        child.start += k
        child.parent = upper
        upper.children[int(child.tokens[0])] = child
        self.nodes[upper.node_id] = upper
        changes.created.append(upper)
        changes.modified.append(child)
        return upper

    def insert_call(
        self,
        execution_id: str,
        call_seq: int,
        prompt: np.ndarray,
        completion: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        agent_id: str = "main",
        known_prefix: tuple[Node, int] | None = None,
    ) -> tuple[CallRecord | None, TreeChanges]:
        """Insert one call; a (execution_id, call_seq) already present changes nothing (returns None)."""
        changes = TreeChanges()
        if (execution_id, call_seq) in self.calls:
            return None, changes
        self._check_lengths(execution_id, call_seq, completion, logprobs, versions)
        seq = np.concatenate([np.asarray(prompt, TOKEN_DTYPE), np.asarray(completion, TOKEN_DTYPE)])
        end = self.insert_sequence(seq, changes, known_prefix)
        return self._record(execution_id, call_seq, end, len(prompt), logprobs, versions, agent_id), changes

    def insert_call_after(
        self,
        execution_id: str,
        call_seq: int,
        base: Node,
        base_len: int,
        prompt_tail: np.ndarray,
        completion: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        agent_id: str = "main",
    ) -> tuple[CallRecord | None, TreeChanges]:
        """`insert_call` of a call whose prompt is the first `base_len` tokens of the sequence ending at
        `base` followed by `prompt_tail` (a compact step): only the tokens after the last node boundary
        at or before `base_len` are compared or copied, never the shared prefix (O(new tokens))."""
        changes = TreeChanges()
        if (execution_id, call_seq) in self.calls:
            return None, changes
        self._check_lengths(execution_id, call_seq, completion, logprobs, versions)
        if not 0 <= base_len <= base.end:
            raise InvalidArgument(
                f"call {execution_id}.{call_seq}: base length {base_len} beyond its base call"
            )
        if base_len + len(prompt_tail) + len(completion) == 0:
            raise InvalidArgument(
                "cannot insert an empty token sequence: a call needs prompt or completion tokens"
            )
        upper, after = locate(base, base_len)
        head = after.tokens[: base_len - after.start] if after is not None else _NO_TOKENS
        rest = np.concatenate(
            [head, np.asarray(prompt_tail, TOKEN_DTYPE), np.asarray(completion, TOKEN_DTYPE)]
        )
        end = self._descend(upper, upper.end if upper.node_id >= 0 else 0, rest, changes)
        prompt_len = base_len + len(prompt_tail)
        return self._record(execution_id, call_seq, end, prompt_len, logprobs, versions, agent_id), changes

    @staticmethod
    def _check_lengths(
        execution_id: str, call_seq: int, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray
    ) -> None:
        if not (len(completion) == len(logprobs) == len(versions)):
            raise InvalidArgument(
                f"call {execution_id}.{call_seq}: completion_token_ids ({len(completion)}), "
                f"completion_logprobs ({len(logprobs)}) and completion_versions ({len(versions)}) "
                "must have the same length"
            )

    def _record(
        self,
        execution_id: str,
        call_seq: int,
        end: Node,
        prompt_len: int,
        logprobs: np.ndarray,
        versions: np.ndarray,
        agent_id: str,
    ) -> CallRecord:
        end.num_call_ends += 1
        rec = CallRecord(
            execution_id,
            call_seq,
            end,
            prompt_len,
            np.asarray(logprobs, LOGPROB_DTYPE).copy(),
            np.asarray(versions, VERSION_DTYPE).copy(),
            agent_id,
        )
        self.add_record(rec)
        return rec

    def add_record(self, rec: CallRecord) -> None:
        self.calls[(rec.execution_id, rec.call_seq)] = rec
        self.calls_by_execution.setdefault(rec.execution_id, {})[rec.call_seq] = rec

    def attach_node(self, node_id: int, parent_id: int | None, tokens: np.ndarray, start: int) -> Node:
        """Rebuild a stored node (loading from Postgres); parents must be attached first."""
        parent = self.root if parent_id is None else self.nodes[parent_id]
        node = Node(node_id, parent, tokens, start)
        parent.children[int(tokens[0])] = node
        self.nodes[node_id] = node
        self.ids.next_id = max(self.ids.next_id, node_id + 1)
        return node

    # ----------------------------------------------------------------- reading
    def sequence(self, node: Node) -> np.ndarray:
        """All tokens from the root to the end of ``node``."""
        return np.concatenate([n.tokens for n in node.path()])

    def export_call(self, rec: CallRecord) -> ExportedCall:
        seq = self.sequence(rec.end_node)
        return ExportedCall(
            rec.call_seq,
            seq[: rec.prompt_len].copy(),
            seq[rec.prompt_len :].copy(),
            rec.completion_logprobs,
            rec.completion_versions,
            rec.agent_id,
        )

    def export_execution(self, execution_id: str) -> list[ExportedCall]:
        calls = self.calls_by_execution.get(execution_id, {})
        return [self.export_call(calls[s]) for s in sorted(calls)]

    def execution_ids(self) -> list[str]:
        return list(self.calls_by_execution)

    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    @property
    def num_tokens(self) -> int:
        return int(sum(len(n.tokens) for n in self.nodes.values()))

    def nodes_of(self, execution_ids: Iterable[str]) -> set[int]:
        """Ids of every node on any call path of the given executions."""
        out: set[int] = set()
        for eid in execution_ids:
            for rec in self.calls_by_execution.get(eid, {}).values():
                n: Node | None = rec.end_node
                while n is not None and n.node_id >= 0 and n.node_id not in out:
                    out.add(n.node_id)
                    n = n.parent
        return out

    def leaves_of(self, execution_id: str) -> list[Node]:
        """End nodes of the execution's calls that no other call of it extends (its root-to-leaf paths)."""
        ends = {
            rec.end_node.node_id: rec.end_node
            for rec in self.calls_by_execution.get(execution_id, {}).values()
        }
        inner: set[int] = set()
        for node in ends.values():
            n = node.parent
            while n is not None and n.node_id >= 0:
                if n.node_id in ends:
                    inner.add(n.node_id)
                n = n.parent
        return [n for nid, n in sorted(ends.items()) if nid not in inner]

    def owned_positions(self, execution_id: str) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Tokens the execution generated, each once: node id -> (mask, logprobs, versions).

        ``mask[i]`` is True where token i of the node lies in a completion span of one of the
        execution's calls. Where several calls generated the same position (identical prefix),
        the lowest call_seq provides the behaviour log-prob and version.
        """
        out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        calls = self.calls_by_execution.get(execution_id, {})
        for seq_no in sorted(calls):
            rec = calls[seq_no]
            n: Node | None = rec.end_node
            while n is not None and n.node_id >= 0 and n.end > rec.prompt_len:
                lo = max(n.start, rec.prompt_len)
                entry = out.get(n.node_id)
                if entry is None:
                    size = len(n.tokens)
                    entry = (
                        np.zeros(size, dtype=bool),
                        np.zeros(size, dtype=LOGPROB_DTYPE),
                        np.full(size, -1, dtype=VERSION_DTYPE),
                    )
                    out[n.node_id] = entry
                mask, lp, ver = entry
                i0 = lo - n.start
                c0 = lo - rec.prompt_len  # index into the completion arrays
                c1 = n.end - rec.prompt_len
                fresh = ~mask[i0:]
                lp[i0:][fresh] = rec.completion_logprobs[c0:c1][fresh]
                ver[i0:][fresh] = rec.completion_versions[c0:c1][fresh]
                mask[i0:] = True
                n = n.parent
        return out

    def generated_tokens(self, execution_id: str) -> int:
        return int(sum(int(m.sum()) for m, _, _ in self.owned_positions(execution_id).values()))

    def completion_tokens(self, execution_id: str) -> np.ndarray:
        """All completion tokens of the execution, in call order (the action sequence, for dedup)."""
        parts = [self.completion_of(r) for _, r in sorted(self.calls_by_execution[execution_id].items())]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=TOKEN_DTYPE)

    def completion_of(self, rec: CallRecord) -> np.ndarray:
        """The call's completion tokens, read from the nodes its completion spans (not its whole path)."""
        pieces: list[np.ndarray] = []
        n: Node | None = rec.end_node
        while n is not None and n.node_id >= 0 and n.end > rec.prompt_len:
            pieces.append(n.tokens[max(0, rec.prompt_len - n.start) :])
            n = n.parent
        pieces.reverse()
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=TOKEN_DTYPE)

    def signature(self, execution_id: str) -> tuple[tuple[int, int, int], ...]:
        """Identity of an execution's token content: equal signatures = exact duplicate executions."""
        calls = self.calls_by_execution.get(execution_id, {})
        return tuple((s, calls[s].end_node.node_id, calls[s].prompt_len) for s in sorted(calls))
