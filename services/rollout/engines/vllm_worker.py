"""Gyre's vLLM worker extension: loads a published weight version into a running `vllm serve`.

vLLM mixes the class named by `--worker-extension-cls` into every worker process it starts (one per
GPU of a tensor-parallel group) and exposes its methods through `POST /collective_rpc` (with
VLLM_SERVER_DEV_MODE=1), whose `args`/`kwargs` are strings. The rollout's VLLMEngine calls

    gyre_load_weights(version="7", uri="file:///run/weights/v000007.safetensors", sha256="ab12...")

between requests (the engine is paused, `POST /pause?mode=wait`). The worker fetches the version
through a `WeightsTransport`, maps Gyre's Megatron parameter names to the HF names of the served
checkpoint (gyre/model/hf.py, the same mapping as `gyre trainer hf export`) and hands the tensors
to the model runner's `reload_weights(weights_iterator=...)`, which shards and fuses them with the
model's own `load_weights` and re-runs each layer's post-load processing, as at start-up.

Guarantees: a file whose sha256 differs from the announced one is refused (nothing is loaded, the
RPC fails with the reason); a URI outside the weights store is refused; each version is hashed once
per worker process; `gyre_weight_version` is the version the worker generates with. Version 0 is
the served checkpoint itself: loading it reloads the model from its directory.

Only the file transport exists today (every worker reads the file the trainer wrote to a store they
share). An NCCL broadcast from the trainer, as verl, OpenRLHF and NeMo-RL do, is another
`WeightsTransport`: `fetch` would receive the tensors instead of reading them, and no caller changes.
What has and has not run against a real vLLM is listed in docs/model.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import torch

from gyre.errors import InvalidArgument
from gyre.model.config import ModelConfig

# Env var naming the weights store the workers may read (set by the rollout when it starts vLLM).
STORE_ENV = "GYRE_WEIGHTS_STORE"


class WeightsTransport(Protocol):
    """Where a worker gets the tensors of a published version, by HF parameter name."""

    def fetch(self, version: int, uri: str, sha256: str) -> Iterator[tuple[str, torch.Tensor]]: ...


def path_in_store(uri: str, store: Path) -> Path:
    """The local path of a `file://` weights URI, refused unless it lies in `store` (symlinks resolved)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise InvalidArgument(f"weights uri {uri!r}: only file:// URIs are loaded by the file transport")
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(store.resolve()):
        raise InvalidArgument(f"weights uri {uri!r} is outside the weights store {store}")
    if not path.is_file():
        raise InvalidArgument(f"weights uri {uri!r}: no such file")
    return path


class FileTransport:
    """Reads a version from the shared weights store, checks its sha256 once, yields HF-named tensors."""

    def __init__(self, store: Path, model_cfg: ModelConfig) -> None:
        self.store, self.model_cfg = store, model_cfg
        self.verified: dict[Path, str] = {}  # path -> sha256 already checked in this process

    def fetch(self, version: int, uri: str, sha256: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Checks the URI and the digest now (before the model is touched), reads the tensors lazily."""
        from gyre.model.weights import sha256_file

        path = path_in_store(uri, self.store)
        if self.verified.get(path) != sha256:
            digest = sha256_file(path)
            if digest != sha256:
                raise InvalidArgument(
                    f"weights v{version} at {path} have sha256 {digest}, announced {sha256}"
                )
            self.verified[path] = sha256
        return self._tensors(path)

    def _tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        from gyre.model.hf import megatron_to_hf

        yield from megatron_to_hf(load_file(str(path)), self.model_cfg).items()


class GyreWorkerExtension:
    """Mixed into vLLM's worker class (`--worker-extension-cls`); `self` is the worker, which has
    `model_runner` (with `reload_weights(weights_iterator=None | iterable of (HF name, tensor))`)
    and `model_config.model` (the served checkpoint directory)."""

    model_runner: Any
    model_config: Any

    def _gyre_transport(self) -> WeightsTransport:
        transport = getattr(self, "_gyre_transport_obj", None)
        if transport is None:
            from gyre.model.hf import read_hf_config

            store = os.environ.get(STORE_ENV)
            if not store:
                raise InvalidArgument(f"{STORE_ENV} is not set: the worker does not know the weights store")
            transport = FileTransport(Path(store), read_hf_config(self.model_config.model))
            self._gyre_transport_obj = transport
        return transport

    def gyre_load_weights(self, version: str, uri: str = "", sha256: str = "") -> str:
        """Load published `version` (strings, as /collective_rpc passes them); returns it."""
        v = int(version)
        if v == 0:
            self.model_runner.reload_weights()  # the served checkpoint, re-read from its directory
        else:
            # reload_weights, not model.load_weights: it reloads layer by layer and re-runs each layer's
            # post-load processing (vLLM's CPU build repacks its linear weights for its GEMM kernels,
            # which drops the per-parameter loaders a second model.load_weights would need)
            self.model_runner.reload_weights(weights_iterator=self._gyre_transport().fetch(v, uri, sha256))
        self._gyre_version = v
        return str(v)

    def gyre_weight_version(self) -> str:
        """The version this worker generates with ("0" until one is loaded)."""
        return str(getattr(self, "_gyre_version", 0))
