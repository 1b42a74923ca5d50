"""Sharding full weights for tensor parallelism follows Megatron's layouts: every split parameter's
shards put back together give the full tensor, SwiGLU's fc1 shards are [gate_r; up_r], the fused
q/k/v is cut by whole query groups, and a mismatch is refused; a context-parallel rank's slice of
queries attends exactly like those rows of the whole tree (dense rows and flex)."""

from __future__ import annotations

import pytest
import torch

from gyre.errors import InvalidArgument
from gyre.model import ModelConfig, build_model
from gyre.model.attention import TreeLayout, TreeRows, attend
from gyre.model.tp_shard import load_full_weights, shard_of
from gyre.model.weights import weights_state


def test_shards_of_every_parameter_reassemble_the_full_tensor_and_fc1_keeps_gate_and_up_halves():
    model = build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=0)
    full = weights_state(model)
    params = dict(model.named_parameters())
    split = 0
    for name, tensor in full.items():
        shards = [shard_of(model, name, tensor, 2, r) for r in range(2)]
        if not getattr(params[name], "tensor_model_parallel", False):
            assert all(s is tensor for s in shards)
            continue
        split += 1
        dim = params[name].partition_dim
        assert all(s.shape[dim] * 2 == tensor.shape[dim] for s in shards)
        if ".linear_fc1." in name:
            gate, up = tensor.chunk(2, dim=0)
            assert torch.equal(shards[1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
            rebuilt = torch.cat([s.chunk(2)[0] for s in shards] + [s.chunk(2)[1] for s in shards])
        else:
            rebuilt = torch.cat(shards, dim=dim)
        assert torch.equal(rebuilt, tensor)
    assert split >= 8  # embedding, output layer, and q/k/v, proj, fc1, fc2 of each layer


def test_qkv_shard_holds_whole_query_groups():
    cfg = ModelConfig(num_attention_heads=4, num_query_groups=2)
    model = build_model(cfg, dtype=torch.float64, seed=0)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = dict(model.named_parameters())[name].detach()
    group_rows = (cfg.num_attention_heads // cfg.kv_heads + 2) * cfg.head_dim  # q heads of a group, k, v
    assert torch.equal(shard_of(model, name, full, 2, 1), full[group_rows:])


def test_loading_full_weights_refuses_missing_names_and_copies_the_rest():
    model = build_model(ModelConfig(), dtype=torch.float64, seed=0)
    other = build_model(ModelConfig(), dtype=torch.float64, seed=1)
    load_full_weights(other, weights_state(model))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    partial = dict(weights_state(model))
    partial.pop("output_layer.weight")
    with pytest.raises(InvalidArgument, match="missing"):
        load_full_weights(other, partial)


def test_dense_mask_rows_are_the_rows_of_the_dense_mask():
    layout = TreeLayout(9, [0, 3, 6], [3, 3, 3], [-1, 0, 0])
    assert torch.equal(layout.dense_mask_rows(4, 9), layout.dense_mask()[4:9])


def test_a_context_parallel_slice_of_queries_attends_like_those_rows_of_the_whole_tree():
    layout = TreeLayout(40, [0, 12, 22, 30], [12, 10, 8, 10], [-1, 0, 0, 1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole = attend(q, k, v, layout, "dense")
    for start, stop in ((0, 20), (20, 40), (13, 31)):
        rows = TreeRows(layout, start, stop)
        sliced = attend(q[:, :, start:stop], k, v, rows, "dense")
        torch.testing.assert_close(sliced, whole[:, :, start:stop], rtol=1e-12, atol=1e-12)
        flex = attend(q[:, :, start:stop], k, v, rows, "flex")  # CPU: forward only
        torch.testing.assert_close(flex, whole[:, :, start:stop], rtol=1e-8, atol=1e-8)
