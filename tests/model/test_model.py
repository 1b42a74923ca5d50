"""The shared model: tree-packed forward equals per-path forward; KV cache equals no cache; weights I/O."""

from __future__ import annotations

import random

import pytest
import torch

from gyre.errors import InvalidArgument
from gyre.model import (
    KVCache,
    ModelConfig,
    TreeLayout,
    build_model,
    causal_logits,
    decode_step,
    greedy_generate,
    load_weights,
    prefill,
    save_weights,
    tree_logits,
    tree_logprobs,
)
from gyre.model.trees import random_tree


def _set_backend(model, backend: str) -> None:
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.backend = backend


@pytest.fixture(scope="module")
def model64():
    return build_model(ModelConfig(num_query_groups=2), dtype=torch.float64, seed=1)


@pytest.mark.parametrize("backend", ["dense", "nodes", "auto"])
def test_tree_logits_equal_each_root_to_leaf_path_run_alone(model64, backend):
    rng = random.Random(7)
    _set_backend(model64, backend)
    try:
        for _ in range(3):
            tree = random_tree(rng, num_nodes=7, max_len=5, num_roots=2)
            tokens = torch.tensor([rng.randrange(512) for _ in range(tree.num_tokens)])
            pos = torch.tensor(tree.position_ids)
            packed = tree_logits(
                model64, tokens, pos, tree.node_offsets, tree.node_lengths, tree.node_parents
            )
            layout = TreeLayout(tree.num_tokens, tree.node_offsets, tree.node_lengths, tree.node_parents)
            for path in layout.path_tokens():
                alone = causal_logits(model64, tokens[path][None], pos[path][None])[0]
                torch.testing.assert_close(packed[path], alone, rtol=1e-10, atol=1e-10)
    finally:
        _set_backend(model64, "auto")


@pytest.mark.parametrize("gqa", [False, True])
def test_node_kernel_batching_same_shaped_nodes_gives_the_dense_output_and_gradients(gqa):
    """Wide trees (equal branches under one prompt, an empty node, two roots) put many nodes in one
    batched call of the ``nodes`` kernel, with shared pieces expanded: output and the gradients of
    q, k and v equal the dense-mask kernel's."""
    from gyre.model.attention import tree_attention
    from gyre.model.trees import shared_prefix_tree

    wide = shared_prefix_tree(prefix_len=6, num_branches=4, branch_len=3, depth=2)
    # then the same tree with an empty root: its branches have no non-empty ancestor (causal alone)
    lengths = wide.node_lengths + [0] + wide.node_lengths[1:]
    parents = (
        wide.node_parents
        + [-1]
        + [p + len(wide.node_lengths) if p > 0 else len(wide.node_lengths) for p in wide.node_parents[1:]]
    )
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    layout = TreeLayout(sum(lengths), offsets, lengths, parents)
    assert any(len(g.nodes) > 1 and len(g.shape) > 1 for g in layout.node_groups())
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads = 4, (2 if gqa else 4)
    q = torch.randn(1, heads, layout.num_tokens, 8, dtype=torch.float64, generator=gen)
    k, v = (
        torch.randn(1, kv_heads, layout.num_tokens, 8, dtype=torch.float64, generator=gen) for _ in range(2)
    )
    grad_out = torch.randn(1, heads, layout.num_tokens, 8, dtype=torch.float64, generator=gen)
    results = []
    for backend in ("dense", "nodes"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = tree_attention(*leaves, layout, backend)
        out.backward(grad_out)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for dense, nodes in zip(*results, strict=True):
        torch.testing.assert_close(nodes, dense, rtol=1e-10, atol=1e-10)


def test_flex_backend_matches_dense_without_grad(model64):
    rng = random.Random(3)
    tree = random_tree(rng, num_nodes=5, max_len=4)
    tokens = torch.tensor([rng.randrange(512) for _ in range(tree.num_tokens)])
    pos = torch.tensor(tree.position_ids)
    arrays = (tree.node_offsets, tree.node_lengths, tree.node_parents)
    with torch.no_grad():
        _set_backend(model64, "dense")
        dense = tree_logits(model64, tokens, pos, *arrays)
        _set_backend(model64, "flex")
        flex = tree_logits(model64, tokens, pos, *arrays)
    _set_backend(model64, "auto")
    torch.testing.assert_close(flex, dense, rtol=1e-8, atol=1e-8)


def test_tree_logprobs_score_each_token_from_its_own_ancestors(model64):
    # root "a b c", two children "d e" and "f": f is predicted from c, not from e.
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    pos = torch.tensor([0, 1, 2, 3, 4, 3])
    lp = tree_logprobs(model64, tokens, pos, [0, 3, 5], [3, 2, 1], [-1, 0, 0])
    path = causal_logits(model64, torch.tensor([[10, 11, 12, 15]]))[0].log_softmax(-1)
    assert lp[0] == 0
    torch.testing.assert_close(lp[5], path[2, 15])
    torch.testing.assert_close(lp[1], path[0, 11])


def test_greedy_decoding_with_kv_cache_equals_decoding_without():
    model = build_model(ModelConfig(), seed=0)
    prompt = [5, 17, 250, 3, 9]
    assert greedy_generate(model, prompt, 12, use_cache=True) == greedy_generate(
        model, prompt, 12, use_cache=False
    )


def test_batched_decode_of_sequences_of_different_lengths_matches_uncached_forward(model64):
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    caches = [KVCache() for _ in seqs]
    for c, s in zip(caches, seqs, strict=True):
        prefill(model64, c, torch.tensor(s), torch.arange(len(s)))
    nxt = torch.tensor([100, 200, 300])
    logits = decode_step(model64, caches, nxt, torch.tensor([len(s) for s in seqs]))
    for b, s in enumerate(seqs):
        full = causal_logits(model64, torch.tensor([s + [int(nxt[b])]]))[0, -1]
        torch.testing.assert_close(logits[b], full, rtol=1e-10, atol=1e-10)
    assert [len(c) for c in caches] == [4, 8, 2]


def test_dropped_cache_re_prefilled_in_chunks_continues_identically(model64):
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])
    whole = KVCache()
    prefill(model64, whole, tokens, torch.arange(6))
    migrated = KVCache()
    prefill(model64, migrated, tokens[:2], torch.arange(2))
    migrated.clear()  # the engine dropped it; re-prefill prompt + generated tokens, in two chunks
    prefill(model64, migrated, tokens[:4], torch.arange(4))
    prefill(model64, migrated, tokens[4:], torch.arange(4, 6))
    a = decode_step(model64, [whole], torch.tensor([3]), torch.tensor([6]))
    b = decode_step(model64, [migrated], torch.tensor([3]), torch.tensor([6]))
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_padded_batch_gives_the_logits_of_each_sequence_alone(model64):
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    batched = causal_logits(model64, ids, lengths=[4, 2])
    alone = causal_logits(model64, ids[1:, :2])[0]
    torch.testing.assert_close(batched[1, :2], alone, rtol=1e-10, atol=1e-10)


def test_weights_round_trip_and_a_wrong_digest_is_refused(tmp_path):
    cfg = ModelConfig(tie_embeddings=True, position_embedding="learned", swiglu=False, add_bias_linear=True)
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=2)
    digest = save_weights(a, tmp_path / "v1.safetensors")
    with pytest.raises(InvalidArgument):
        load_weights(b, tmp_path / "v1.safetensors", expected_sha256="0" * 64)
    load_weights(b, tmp_path / "v1.safetensors", expected_sha256=digest)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(causal_logits(a, ids), causal_logits(b, ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    "offsets,lengths,parents",
    [([0, 2], [2, 2], [-1, 1]), ([0, 3], [2, 2], [-1, 0]), ([0], [3], [-1])],
)
def test_malformed_tree_arrays_are_rejected(offsets, lengths, parents):
    with pytest.raises(InvalidArgument):
        TreeLayout(4, offsets, lengths, parents)


def test_out_of_vocabulary_token_is_rejected(model64):
    with pytest.raises(InvalidArgument):
        causal_logits(model64, torch.tensor([[1, 512]]))


def test_models_built_at_once_in_threads_with_one_seed_equal_the_one_built_alone():
    # Rollout engines start in worker threads; the trainer builds its replica elsewhere with the
    # same seed. Interleaved draws from torch's global RNG gave every engine other initial weights.
    from concurrent.futures import ThreadPoolExecutor

    cfg = ModelConfig.model_validate({"init_std": 0.2})
    alone = build_model(cfg, seed=3).state_dict()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: build_model(cfg, seed=3), range(4)))
    for model in built:
        for name, value in model.state_dict().items():
            if torch.is_tensor(value) and value.is_floating_point():
                assert torch.equal(value, alone[name]), name
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left as it was


def test_flex_block_mask_is_built_once_per_micro_batch_and_logits_are_unchanged(model64, monkeypatch):
    """Counts torch's create_block_mask calls (a pass-through spy on torch, not on our code): one
    per layout however many layers attend, and a new layout (the next micro-batch) builds its own."""
    from torch.nn.attention import flex_attention as flex

    from gyre.model.attention import TreeLayout
    from gyre.model.forward import hidden_states, logits_from_hidden

    calls: list[int] = []
    real = flex.create_block_mask

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex, "create_block_mask", counting)
    rng = random.Random(5)
    tree = random_tree(rng, num_nodes=6, max_len=4)
    tokens = torch.tensor([rng.randrange(512) for _ in range(tree.num_tokens)])
    pos = torch.tensor(tree.position_ids)
    arrays = (tree.node_offsets, tree.node_lengths, tree.node_parents)
    assert len(model64.decoder.layers) >= 2
    with torch.no_grad():
        _set_backend(model64, "dense")
        dense = tree_logits(model64, tokens, pos, *arrays)
        assert calls == []
        _set_backend(model64, "flex")
        for micro in range(2):  # two micro-batches: a layout each, one mask each
            layout = TreeLayout(tree.num_tokens, *arrays)
            hidden = hidden_states(model64, tokens[None], pos[None], layout)
            hidden_states(model64, tokens[None], pos[None], layout)  # the same micro-batch again
            assert len(calls) == micro + 1
            torch.testing.assert_close(logits_from_hidden(model64, hidden[0]), dense, rtol=1e-8, atol=1e-8)
    _set_backend(model64, "auto")
