"""Weight files: safetensors of the model's state dict, identified by their sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from gyre.errors import InvalidArgument


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors that define the model (parameters and tensor buffers; Megatron's extra state skipped)."""
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor) and not name.endswith("_extra_state"):
            out[name] = t.detach().to("cpu").contiguous()
    return out


def save_weights(model: Any, path: str | Path) -> str:
    """Write the model's weights as safetensors (atomically: temp file + rename); return the sha256."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    state = weights_state(model)
    # Tied tensors share storage; safetensors refuses shared storage, so clone each.
    save_file({k: v.clone() for k, v in state.items()}, str(tmp))
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    return digest


def load_weights(model: Any, path: str | Path, expected_sha256: str | None = None) -> None:
    """Load a safetensors file into `model` in place; refuse it if its sha256 differs (InvalidArgument)."""
    from safetensors.torch import load_file

    path = Path(path)
    if expected_sha256 is not None:
        digest = sha256_file(path)
        if digest != expected_sha256:
            raise InvalidArgument(
                f"weights {path} have sha256 {digest}, expected {expected_sha256}: refusing them"
            )
    state = load_file(str(path))
    own = weights_state(model)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise InvalidArgument(
            f"weights {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        params = dict(model.state_dict(keep_vars=True))
        for name, t in state.items():
            if params[name].shape != t.shape:
                raise InvalidArgument(
                    f"weights {path}: {name} has shape {tuple(t.shape)}, model {tuple(params[name].shape)}"
                )
            params[name].copy_(t.to(params[name].device, params[name].dtype))
