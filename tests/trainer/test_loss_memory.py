"""The chunked log-prob / entropy loss peaks below the full one, measured in fresh processes, and
both compute the same loss (services/trainer/loss_memory.py)."""

from __future__ import annotations

import pytest

from services.trainer.bench import loss_memory_line
from services.trainer.loss_memory import measure_loss_memory


@pytest.mark.slow  # two spawned children, each importing torch: ~5 s
def test_the_chunked_loss_peaks_below_the_full_one_and_computes_the_same_loss() -> None:
    m = measure_loss_memory(tokens=2048, vocab=8192, hidden=64, chunk_tokens=256)
    assert m["device"] == "cpu"
    assert m["full_peak_bytes"] > 2048 * 8192 * 4  # at least one fp32 copy of the T x V logits
    assert 0 < m["chunked_peak_bytes"] < m["full_peak_bytes"]
    assert m["ratio"] > 1.5
    assert m["loss_rel_diff"] <= 1e-4
    assert m["full_s"] > 0 and m["chunked_s"] > 0
    assert loss_memory_line(m).startswith("loss peak memory: full ")


def test_the_sizes_are_checked() -> None:
    with pytest.raises(ValueError):
        measure_loss_memory(tokens=16, vocab=32, hidden=8, chunk_tokens=0)
