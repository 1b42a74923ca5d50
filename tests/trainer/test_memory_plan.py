"""The trainer memory planner (services/trainer/memory_plan.py) and `gyre plan trainer`: pure arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.plan_trainer import load_model, main
from gyre.model.config import ModelConfig
from services.trainer.memory_plan import GIB, MemoryPlan, parameter_count, plan_memory

LLAMA_7B = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-7b.yaml"
QWEN3_8B = LLAMA_7B.with_name("qwen3-8b.yaml")


def _plan(model: ModelConfig, **change: object) -> MemoryPlan:
    kwargs: dict[str, object] = {
        "tokens": 32768,
        "param_dtype": "bf16",
        "fp32_master": True,
        "recompute": False,
        "loss_chunk_tokens": None,
        "device_bytes": 80 * GIB,
    }
    kwargs.update(change)
    return plan_memory(model, **kwargs)  # type: ignore[arg-type]


def test_llama_7b_parameter_count() -> None:
    count = parameter_count(load_model(LLAMA_7B))
    assert abs(count - 6.74e9) / 6.74e9 < 0.01


def test_qwen3_8b_parameter_count() -> None:
    assert abs(parameter_count(load_model(QWEN3_8B)) - 8.19e9) / 8.19e9 < 0.01


def test_bf16_params_are_two_bytes_each() -> None:
    model = load_model(LLAMA_7B)
    plan = _plan(model)
    assert plan.params == 2 * parameter_count(model)
    # Adam: two fp32 moments + fp32 master copy = 12 bytes per parameter; sharding divides them.
    assert plan.optimizer == 12 * parameter_count(model)
    assert _plan(model, dp_size=8, shard_optimizer=True).optimizer == -(-plan.optimizer // 8)
    assert _plan(model, fp32_master=False).optimizer == 8 * parameter_count(model)


def test_chunked_loss_is_smaller_by_tokens_over_chunk() -> None:
    model = load_model(LLAMA_7B)
    tokens, chunk = 32768, 4096
    full, chunked = _plan(model, tokens=tokens), _plan(model, tokens=tokens, loss_chunk_tokens=chunk)
    norm = tokens * model.hidden_size * 2 * 2  # final norm's input + output, the same in both
    assert (full.loss - norm) == (chunked.loss - norm) * (tokens // chunk)


def test_recompute_lowers_activations() -> None:
    model = load_model(LLAMA_7B)
    assert _plan(model, recompute=True).activations < _plan(model).activations / 5


def test_7b_at_1m_tokens_does_not_fit_and_cli_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert not _plan(load_model(LLAMA_7B), tokens=1 << 20).fits
    assert main(["--model", str(LLAMA_7B), "--tokens", "1048576", "--device-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    assert "--recompute" in out and "--shard-optimizer" in out and "more devices" in out


def test_tiny_model_fits_and_cli_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(ModelConfig(), tokens=1024).fits
    assert main(["--tokens", "1024"]) == 0
    assert "FITS" in capsys.readouterr().out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert (
        main(
            [
                "--model",
                str(LLAMA_7B),
                "--tokens",
                "32768",
                "--recompute",
                "--loss-chunk-tokens",
                "4096",
                "--dp",
                "8",
                "--shard-optimizer",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["total"] <= doc["device_bytes"]


def test_tensor_and_context_parallel_divide_a_devices_share_as_the_trainer_splits_it() -> None:
    model = load_model(LLAMA_7B)
    whole = _plan(model, recompute=True, loss_chunk_tokens=4096)
    tp8 = _plan(model, recompute=True, loss_chunk_tokens=4096, tp_size=8)
    # only norms are replicated in Llama (no biases, RoPE): a little more than 1/8 of the state each
    for part in ("params", "grads", "optimizer"):
        assert getattr(whole, part) / 8 < getattr(tp8, part) < getattr(whole, part) / 8 * 1.001
    # no sequence parallelism: the layer inputs kept under recompute stay whole on every TP rank
    layer_inputs = 32768 * model.num_layers * 2 * model.hidden_size
    assert tp8.activations > layer_inputs
    cp4 = _plan(model, recompute=True, loss_chunk_tokens=4096, cp_size=4)
    assert cp4.params == whole.params
    assert cp4.activations < whole.activations / 3  # T/4 tokens, plus the gathered keys and values
    gathered_kv = (32768 - 8192) * 2 * 2 * model.kv_heads * model.head_dim
    assert (
        cp4.activations
        == _plan(model, tokens=8192, recompute=True, loss_chunk_tokens=4096).activations + gathered_kv
    )
    with pytest.raises(ValueError, match="must divide"):
        _plan(model, tp_size=3)


def test_gyre_plan_trainer_takes_tp_and_cp(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(LLAMA_7B), "--tokens", "1048576", "--recompute", "--loss-chunk-tokens", "4096"]
    assert main(args) == 1
    assert main([*args, "--tp", "8", "--cp", "8"]) == 0
    assert "tp_size=8, cp_size=8" in capsys.readouterr().out
    assert main([*args, "--tp", "3"]) == 2
