"""Flat-buffer helpers for the data-parallel group's collectives (one buffer per dtype and device)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def flat_by_dtype(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(one flat copy of the members, the members) per (dtype, device), in first-seen order: every rank
    that passes tensors of the same shapes in the same order gets buffers of the same layout."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for members in groups.values():
        yield torch.cat([t.detach().reshape(-1) for t in members]), members


def unflatten_into(flat: torch.Tensor, members: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `members` (the inverse of `flat_by_dtype`)."""
    offset = 0
    with torch.no_grad():
        for t in members:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
