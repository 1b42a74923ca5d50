"""`gyre plan trainer`'s state formulas are what the trainer holds (bf16 + fp32 masters, ZeRO-1, KL reference)."""

from __future__ import annotations

from services.trainer.config import TrainerConfig
from services.trainer.memory_plan import plan_memory
from services.trainer.sharded_optimizer import MasterAdamW, assign_owners
from services.trainer.step import build_replica, train_batch
from tests.trainer.helpers import random_batch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_plan_counts_the_bytes_a_bf16_master_trainer_holds_after_a_step():
    cfg = TrainerConfig(device="cpu", precision="bf16", kl_coef=0.1, micro_batch_tokens=40)
    model, optimizer, ref, settings = build_replica(cfg, seed=0)
    train_batch(model, optimizer, random_batch(1, num_nodes=12), settings, ref, 1.0, 40)
    assert isinstance(optimizer, MasterAdamW) and optimizer.main_grads is not None and ref is not None
    plan = plan_memory(
        cfg.model,
        tokens=64,
        param_dtype="bf16",
        fp32_master=True,
        recompute=False,
        loss_chunk_tokens=None,
        device_bytes=0,
        kl_reference=True,
    )
    params = list(model.parameters())
    assert plan.parameter_count == sum(p.numel() for p in params)
    assert plan.params == _bytes(params)
    assert plan.grads == _bytes(optimizer.main_grads)
    assert all(p.grad is None for p in params), "no bf16 gradient outlives the fold"
    steps = [e["step"] for e in optimizer.entries().values()]  # AdamW's scalar step counters
    assert plan.optimizer == optimizer.state_bytes() - _bytes(steps)
    assert plan.reference == _bytes(ref.parameters())


def test_the_planned_zero1_shard_bounds_what_each_rank_is_assigned():
    cfg = TrainerConfig(device="cpu")
    model, _, _, _ = build_replica(cfg, seed=0)
    numels = [p.numel() for p in model.parameters()]
    for dp in (2, 3, 4):
        plan = plan_memory(
            cfg.model,
            tokens=64,
            param_dtype="bf16",
            fp32_master=True,
            dp_size=dp,
            shard_optimizer=True,
            recompute=False,
            loss_chunk_tokens=None,
            device_bytes=0,
        )
        per_rank = [0] * dp
        for n, r in zip(numels, assign_owners(numels, dp), strict=True):
            per_rank[r] += 12 * n  # fp32 master + two fp32 moments
        assert sum(per_rank) == 12 * sum(numels)
        assert max(per_rank) <= plan.optimizer + 12 * max(numels)
        assert min(per_rank) >= plan.optimizer - 12 * max(numels)


def test_the_planned_tensor_parallel_shard_is_what_the_model_splits_to_each_rank():
    import torch

    from gyre.model import ModelConfig, build_model
    from gyre.model.tp_shard import shard_of

    configs = [
        ModelConfig(num_query_groups=4, num_attention_heads=8),
        ModelConfig(
            normalization="LayerNorm",
            swiglu=False,
            add_bias_linear=True,
            position_embedding="learned",
            tie_embeddings=True,
            ffn_hidden_size=128,
        ),
        ModelConfig(qk_layernorm=True, add_qkv_bias=True),
    ]
    for model_cfg in configs:
        model = build_model(model_cfg, dtype=torch.float32, seed=0)
        for tp in (1, 2, 4):
            plan = plan_memory(
                model_cfg,
                tokens=64,
                param_dtype="fp32",
                fp32_master=False,
                recompute=False,
                loss_chunk_tokens=None,
                device_bytes=0,
                tp_size=tp,
            )
            for rank in range(tp):
                shard = [shard_of(model, n, p, tp, rank) for n, p in model.named_parameters()]
                assert plan.params == _bytes(shard), (model_cfg, tp, rank)
