"""Splitting a tree larger than the micro-batch budget into parts along its nodes (segments).

A part trains some of the tree's nodes and carries, as untrained *context*, every ancestor of those
nodes that it does not train itself. The context is recomputed in the part's forward with gradients
(nothing is cached or detached), so a trained token sees exactly the keys and values it sees in the
whole tree and its loss term is the same function of the parameters: the parts' losses and
gradients add up to the whole tree's (each node is trained in exactly one part). Context tokens
carry no loss (services/trainer/batch.py zeroes their mask and weights).

Budget rule. Without context parallelism a part that trains a node must hold that node's whole
ancestor chain, so no split can go below the tree's longest root-to-leaf path; a part holds at most
max(budget, longest path) tokens, context included. A tree whose longest path is within the budget
is therefore split into parts of at most the budget; a single chain (one path) longer than the budget
stays whole, as splitting it would only add recomputation. Nodes are taken in their order, greedily:
a node joins the current part when the part stays within that cap with the node and whichever of
its ancestors the part lacks; otherwise it starts the next part. The cost is the context recomputed
per part (a shared prompt once per part instead of once per tree), so a split is bounded: when the
parts would recompute more context than `max_recompute` times the tree's own tokens (default
`MAX_RECOMPUTE` = 1: at most twice the tree's forward and backward work), the tree stays whole
instead. That keeps, for example, a 3,000-token prompt with ten 100-token answers under a 2,048-token
budget from becoming ten parts of 3,100 tokens (7.75x the work) to save a quarter of the peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_RECOMPUTE = 1.0
"""Default bound on a split's recomputed context, as a fraction of the tree's tokens (module docstring)."""


@dataclass(frozen=True)
class TreePart:
    """A set of one tree's nodes: `nodes` (ascending indices) = the `trained` ones plus their ancestors
    (context); `trained` None means every node is trained (a whole tree)."""

    nodes: list[int]
    trained: frozenset[int] | None
    num_tokens: int

    def is_trained(self, node: int) -> bool:
        return self.trained is None or node in self.trained


def split_tree(
    node_lengths: Sequence[int],
    node_parents: Sequence[int],
    first: int,
    end: int,
    max_tokens: int,
    max_recompute: float = MAX_RECOMPUTE,
) -> list[TreePart]:
    """The parts of the tree made of nodes [first, end) (node `first` is its root; parents are indices
    into the same arrays) under a budget of `max_tokens` tokens per part (module docstring). Every
    node is trained by exactly one part, in node order; each part's nodes include all ancestors of its
    trained nodes. One whole part when the tree fits, or when splitting would recompute more than
    `max_recompute` x its tokens."""
    chains: dict[int, list[int]] = {}
    path_tokens: dict[int, int] = {}
    for i in range(first, end):
        p = node_parents[i]
        chains[i] = (chains[p] if p >= first else []) + [i]
        path_tokens[i] = (path_tokens[p] if p >= first else 0) + node_lengths[i]
    total = sum(node_lengths[first:end])
    cap = max(max_tokens, max(path_tokens.values(), default=0))
    if total <= cap:
        return [TreePart(list(range(first, end)), None, total)]
    parts: list[TreePart] = []
    trained: list[int] = []
    held: set[int] = set()
    size = 0
    for i in range(first, end):
        missing = [j for j in chains[i] if j not in held]
        extra = sum(node_lengths[j] for j in missing)
        if trained and size + extra > cap:
            parts.append(TreePart(sorted(held), frozenset(trained), size))
            trained, held, size = [], set(), 0
            missing = chains[i]
            extra = path_tokens[i]
        trained.append(i)
        held.update(missing)
        size += extra
    parts.append(TreePart(sorted(held), frozenset(trained), size))
    if sum(p.num_tokens for p in parts) - total > max_recompute * total:
        return [TreePart(list(range(first, end)), None, total)]
    return parts
