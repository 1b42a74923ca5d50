"""Random tree layouts for tests and benchmarks (pure Python, no torch)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class TreeArrays:
    """Ancestry arrays of one tree-packed sequence plus each token's original position id."""

    node_offsets: list[int]
    node_lengths: list[int]
    node_parents: list[int]
    position_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.node_lengths)


def random_tree(
    rng: random.Random, num_nodes: int, min_len: int = 1, max_len: int = 6, num_roots: int = 1
) -> TreeArrays:
    """A random forest of `num_nodes` nodes laid out in depth-first order (as BatchChunk requires).

    The first `num_roots` nodes start trees; every later node hangs under a random earlier node, so
    branching is common. Positions continue from the parent's last position.
    """
    parents = [-1] * num_roots + [rng.randrange(i) for i in range(num_roots, num_nodes)]
    lengths = [rng.randint(min_len, max_len) for _ in range(num_nodes)]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    order: list[int] = []
    stack = list(reversed(children.get(-1, [])))
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children.get(n, [])))
    new_index = {old: new for new, old in enumerate(order)}
    offsets: list[int] = []
    lens: list[int] = []
    pars: list[int] = []
    positions: list[int] = []
    end_pos: dict[int, int] = {}
    off = 0
    for old in order:
        p = parents[old]
        start = end_pos[p] if p >= 0 else 0
        offsets.append(off)
        lens.append(lengths[old])
        pars.append(new_index[p] if p >= 0 else -1)
        positions.extend(range(start, start + lengths[old]))
        end_pos[old] = start + lengths[old]
        off += lengths[old]
    return TreeArrays(offsets, lens, pars, positions)


def shared_prefix_tree(prefix_len: int, num_branches: int, branch_len: int, depth: int = 1) -> TreeArrays:
    """A prompt of `prefix_len` tokens with `num_branches` branches of `branch_len`, each
    branching again `depth - 1` times into two (an agent's retries / sub-agents)."""
    offsets, lens, pars, positions = [0], [prefix_len], [-1], list(range(prefix_len))

    def grow(parent: int, start: int, level: int) -> None:
        fan = num_branches if level == 1 else 2
        for _ in range(fan):
            idx = len(offsets)
            offsets.append(sum(lens))
            lens.append(branch_len)
            pars.append(parent)
            positions.extend(range(start, start + branch_len))
            if level < depth:
                grow(idx, start + branch_len, level + 1)

    grow(0, prefix_len, 1)
    return TreeArrays(offsets, lens, pars, positions)
