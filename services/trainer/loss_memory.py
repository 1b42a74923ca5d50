"""Peak memory of the sampled-token loss, chunked vs full, each variant in its own fresh process.

What is measured: forward + backward of `logprob.sum() + entropy.sum()` over the output layer
(hidden states [tokens, hidden] and output weight [vocab, hidden], both requiring grad; random
int targets), once with `full_logprob_entropy` (all tokens x vocab logits at once) and once with
`chunked_logprob_entropy` (`chunk_tokens` x vocab at a time). Each variant runs in a child started
with multiprocessing's 'spawn' context, so neither sees the other's (or the caller's) allocator
state. The inputs are built and a tiny warm-up of the same variant is run first; the peak is what
one forward + backward adds on top of that baseline: its intermediates, its autograd graph and the
gradients of hidden and weight (the same [tokens, hidden] + [vocab, hidden] in both variants).

Units: `*_peak_bytes` in bytes, `*_s` in seconds (wall clock of a second forward + backward, after
the measured one), `ratio` = full / chunked peak (dimensionless), `loss_rel_diff` = |full - chunked| / |full| of the loss value.

How: on CUDA, `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (method "cuda
max_memory_allocated"). On CPU, the child's resident-set high-water mark: on Linux the process's
own `VmHWM` from /proc/self/status, reset to the current RSS through /proc/self/clear_refs just
before the loss (method "VmHWM delta"). `ru_maxrss` (method "ru_maxrss delta", the fallback where
/proc is missing) is not used on Linux because a forked-then-exec'd child inherits its parent's
maxrss: under a caller holding more RSS than the loss needs, the delta would read as zero. The CPU
child pins glibc's mmap threshold at 64 KiB (`_mallopt`), so that RSS follows the live tensors:
left to itself glibc raises the threshold as large blocks are freed (up to 32 MiB) and keeps
chunk-sized tensors in its heap, and RSS adds fragmentation (179 MiB instead of 62 MiB for the
chunked variant at 2048 tokens x 8192 vocab, chunks of 256). The timed run uses 32 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import multiprocessing
import resource
import time
from pathlib import Path
from typing import Any

_PROC = Path("/proc/self")


def _rss_kib(field: str) -> int | None:
    """`VmRSS` / `VmHWM` of this process in KiB, or None without /proc."""
    try:
        for line in (_PROC / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Resets this process's RSS high-water mark to its current RSS (Linux); False if unsupported."""
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        return False
    return _rss_kib("VmHWM") is not None


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc: allocations of `mmap_threshold` bytes or more get their own mapping (returned to the
    OS on free), the heap is trimmed once `trim_threshold` bytes are free at its top; both fixed
    (glibc's own adjustment off). False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(-3, mmap_threshold) == 1 and libc.mallopt(-1, trim_threshold) == 1)
    except (OSError, AttributeError):
        return False


def _loss(variant: str, hidden: Any, weight: Any, targets: Any, chunk_tokens: int) -> Any:
    from services.trainer.chunked_softmax import chunked_logprob_entropy, full_logprob_entropy

    if variant == "full":
        logprob, entropy = full_logprob_entropy(hidden, weight, targets)
    else:
        logprob, entropy = chunked_logprob_entropy(hidden, weight, targets, chunk_tokens)
    return logprob.sum() + entropy.sum()


def _inputs(tokens: int, vocab: int, hidden: int, dtype: str, device: str, seed: int) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dt).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device=device, dtype=dt).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return h, w, y


def _child(
    variant: str, tokens: int, vocab: int, hidden: int, chunk_tokens: int, dtype: str, device: str
) -> dict[str, Any]:
    """Runs in the spawned child: one forward + backward of `variant`, its peak over the baseline;
    then one more, timed."""
    cuda = device.startswith("cuda")
    if not cuda:  # RSS = live tensors: every tensor of 64 KiB or more is its own mapping
        _mallopt(64 * 1024, 128 * 1024)
    import torch

    def step() -> float:
        loss = _loss(variant, h, w, y, chunk_tokens)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        return float(loss.item())

    # Warm-up on tiny inputs: kernels, thread pools and allocator arenas are not the loss's memory.
    h, w, y = _inputs(8, 64, hidden, dtype, device, seed=1)
    step()
    h, w, y = _inputs(tokens, vocab, hidden, dtype, device, seed=0)
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        method = "cuda max_memory_allocated"
    elif _reset_hwm():
        base = (_rss_kib("VmRSS") or 0) * 1024
        method = "VmHWM delta"
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        method = "ru_maxrss delta"
    value = step()
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    elif method == "VmHWM delta":
        peak = (_rss_kib("VmHWM") or 0) * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Timed: a second forward + backward, glibc thresholds where its own adjustment would take them
    # for such tensors (a fresh mapping per chunk costs page faults that a trainer would not pay).
    h.grad = w.grad = None
    if not cuda:
        _mallopt(32 * 1024 * 1024, 64 * 1024 * 1024)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"peak_bytes": float(peak - base), "seconds": seconds, "loss": value, "method": method}


def _run_child(variant: str, *args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out: dict[str, Any] = pool.apply(_child, (variant, *args))
    return out


def measure_loss_memory(
    tokens: int, vocab: int, hidden: int, chunk_tokens: int, dtype: str = "float32", device: str = "cpu"
) -> dict[str, Any]:
    """Peak memory (bytes) and time (s) of forward + backward of the log-prob + entropy loss over a
    [tokens, hidden] x [vocab, hidden] output layer, full vs chunked (`chunk_tokens` per chunk),
    each in its own spawned process on the same random inputs. Raises AssertionError if the two
    loss values differ by more than 1e-4 relative. Keys: see the module docstring."""
    if min(tokens, vocab, hidden, chunk_tokens) < 1:
        raise ValueError("tokens, vocab, hidden and chunk_tokens must be >= 1")
    args = (tokens, vocab, hidden, chunk_tokens, dtype, device)
    full = _run_child("full", *args)
    chunked = _run_child("chunked", *args)
    rel = abs(full["loss"] - chunked["loss"]) / max(abs(full["loss"]), 1e-30)
    assert rel <= 1e-4, f"full loss {full['loss']} != chunked loss {chunked['loss']} (rel {rel:.3g})"
    return {
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden,
        "chunk_tokens": chunk_tokens,
        "dtype": dtype,
        "full_peak_bytes": full["peak_bytes"],
        "chunked_peak_bytes": chunked["peak_bytes"],
        "ratio": round(full["peak_bytes"] / max(chunked["peak_bytes"], 1.0), 3),
        "full_s": round(full["seconds"], 4),
        "chunked_s": round(chunked["seconds"], 4),
        "loss_rel_diff": rel,
        "device": device,
        "method": full["method"],
    }
