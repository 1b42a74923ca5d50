"""The policy-gradient loss over a tree-packed batch, and the numbers that show how learning goes.

Per token t of a path p with importance ratio r_t = exp(logp_t - behaviour_logp_t) and weight
w_{p,t} = A_{p,t} * norm_p (A_{p,t}: the advantage of the call of p that generated t), the
PPO-clipped objective with asymmetric ("clip-higher") bounds is
    -min(r_t * A_{p,t}, clip(r_t, 1 - eps_low, 1 + eps_high) * A_{p,t}) * norm_p
  = w_{p,t} * l+(r_t)  if w_{p,t} >= 0, with l+(r) = -min(r, clip(r))
  = w_{p,t} * l-(r_t)  if w_{p,t} <  0, with l-(r) = -max(r, clip(r)).
r_t depends only on t's ancestors, so it is the same on every path through t, and summing over
paths gives  sum_t weight_pos_t * l+(r_t) + weight_neg_t * l-(r_t)
             + kl_coef * kl_weight_t * kl_t - entropy_coef * kl_weight_t * H_t:
exactly the loss — and gradient — of training each path as its own sample (tested in float64).
The importance ratio corrects tokens sampled by older weights (staleness).

The algorithm (why these terms; docs/trainer.md, "The RL algorithm"):
- Group-relative advantages with per-call credit assignment (services/trajectory/scoring.py,
  `trajectory.credit_assignment`: one advantage per execution, per call from the progress each call
  made, or per call from task-tree node values) with a token-mean normalisation (the trajectory
  service's weights): every generated token of every execution counts once, with the advantage of
  the call that generated it. The loss below only sees per-token weights.
- Clip-higher (DAPO, Yu et al. 2025): `clip_eps_high` > `clip_eps` lets a token whose probability
  is low rise further within one step, while the lower bound still stops a collapse of probable
  tokens; with staleness (ratios != 1) this keeps rare good actions learnable.
- Batch advantage normalisation (`normalise_advantages`, PPO's advantage normalisation over the
  batch): the policy-gradient term is divided by the RMS of the advantages of the batch's trained
  tokens (`advantage_rms`; group means are already subtracted, so it is their std about 0). The
  step's direction is unchanged; its size no longer depends on the reward scale, which per-call
  credit makes small (progress per call ~ 1/horizon) and which shrinks as groups converge, and
  `entropy_coef` weighs the bonus against advantages of unit RMS. Unlike GRPO's per-group std
  (`trajectory.normalise_advantage_std`) it does not blow up the rare difference of a nearly
  converged group relative to the others. The trainer computes it over the whole step's batch and
  scales the weights before cutting micro-batches and shards (`normalise_advantages`), so a step
  is the same on any number of ranks and across a mid-step resize; `tree_loss` with the setting on
  divides by the RMS of the batch it is given (the whole step in `examples/rl_loop.py`). A streamed
  step does not know its whole batch when it starts, so `trainer.streaming` refuses this setting.
- Entropy bonus: `entropy_coef` * H(pi(.|ancestors)) at every trained token (the full-vocabulary
  entropy, nats, token-mean weighted like the KL). Without it a peaked policy becomes
  deterministic on some wrong actions, every execution of a group then behaves alike, the group's
  reward variance and so every advantage is zero, and nothing can move the policy again (a stall).
- KL to a reference model (optional, `kl_coef`) uses the k3 estimator exp(ref - logp) - (ref - logp) - 1.

Parallel layouts (docs/trainer.md, "Parallelism"): under Megatron tensor parallelism every TP rank
computes the same loss, with log-prob and entropy vocabulary-parallel (services/trainer/vocab_parallel.py);
under context parallelism each CP rank computes the terms of the tokens it owns (those its slice's
hidden states predict), so the CP ranks' losses and gradients add up to the micro-batch's, and its
metrics count those tokens only.

Metrics (token means over trained tokens, unweighted): `entropy` (nats), `kl_behaviour` (k3
estimate of KL(behaviour || policy), the drift since the tokens were sampled: (r - 1) - log r),
`clip_fraction` (ratios outside [1 - eps_low, 1 + eps_high]), `ratio_mean`, `kl_mean` (to the
reference, when kl_coef > 0). The loss is a sum over tokens (the trajectory service's weights
carry the normalisation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gyre.errors import InvalidArgument
from gyre.model.attention import TreeLayout, TreeRows
from gyre.model.forward import hidden_states, predecessor_index
from gyre.model.parallel import NOT_PARALLEL, ModelParallel, cp_token_range, gather_sequence
from services.trainer.batch import PackedBatch
from services.trainer.chunked_softmax import chunked_logprob_entropy
from services.trainer.vocab_parallel import vocab_parallel_logprob_entropy

ADVANTAGE_RMS_FLOOR = 1e-6
"""Score units: a batch whose advantages' RMS is below this is not rescaled (its policy-gradient term is ~0)."""


@dataclass(frozen=True)
class LossSettings:
    """The loss terms' coefficients (see the module docstring; fields of TrainerConfig)."""

    clip_eps: float = 0.2  # lower ratio bound 1 - clip_eps
    clip_eps_high: float | None = None  # upper bound 1 + clip_eps_high; None = clip_eps (symmetric)
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    entropy_target: float | None = None  # nats; the bonus counts min(H_t, target); None = H_t
    normalise_advantages: bool = False  # divide the policy-gradient term by the advantages' RMS
    chunk_tokens: int = 4096  # tokens whose logits exist at once (chunked_softmax); the loss holds chunk x V

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @classmethod
    def from_config(cls, cfg: Any) -> LossSettings:
        """The settings a TrainerConfig names (clip_eps, clip_eps_high, kl_coef, entropy_coef,
        entropy_target, normalise_batch_advantages, loss_chunk_tokens)."""
        return cls(
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef,
            entropy_target=cfg.entropy_target,
            normalise_advantages=cfg.normalise_batch_advantages,
            chunk_tokens=cfg.loss_chunk_tokens,
        )


def clipped_token_losses(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weighted clipped losses [T] (0 where loss_mask is 0) and the ratios [T].

    Ratios are clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high None = clip_eps)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(torch.where(loss_mask, logprobs - behaviour_logprobs, torch.zeros_like(logprobs)))
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss_pos = -torch.minimum(ratio, clipped)
    loss_neg = -torch.maximum(ratio, clipped)
    per_token = weight_pos * loss_pos + weight_neg * loss_neg
    return torch.where(loss_mask, per_token, torch.zeros_like(per_token)), ratio


def advantage_rms(batch: PackedBatch) -> float:
    """Root mean square of the advantages of a packed batch's trained tokens, each token counted with
    the weight of the paths that train it (score units; 0 when nothing is trained).

    A token's advantage is (weight_pos + weight_neg) / kl_weight: the norm-weighted mean advantage of
    the paths through it (kl_weight sums their norms, services/trajectory/packing.py), so this is
    sqrt(sum_t kl_weight_t a_t^2 / sum_t kl_weight_t) = the RMS over every member's trained tokens.
    Group means are already subtracted, so it is the batch's advantage std about 0."""
    trained = batch.loss_mask & (batch.kl_weight > 0)
    kw = batch.kl_weight[trained].double()
    if kw.numel() == 0 or float(kw.sum()) <= 0.0:
        return 0.0
    a = (batch.weight_pos + batch.weight_neg)[trained].double() / kw
    return float(((kw * a * a).sum() / kw.sum()).sqrt())


def normalise_advantages(batch: PackedBatch) -> tuple[PackedBatch, float]:
    """`batch` with its policy-gradient weights (weight_pos, weight_neg) divided by its advantage RMS,
    and that RMS (unchanged below ADVANTAGE_RMS_FLOOR). `tree_loss` of the result without
    normalisation equals `tree_loss` of `batch` with it (the loss is linear in these weights), and
    since the weights are scaled before the batch is cut, every micro-batch and data-parallel shard
    of a step is divided by the same step-wide RMS: the step does not depend on how it is sharded."""
    rms = advantage_rms(batch)
    if rms <= ADVANTAGE_RMS_FLOOR:
        return batch, rms
    return dataclasses.replace(
        batch, weight_pos=batch.weight_pos / rms, weight_neg=batch.weight_neg / rms
    ), rms


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, k3 form."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def output_weight(model: Any) -> torch.Tensor:
    """The output layer's weight [V, hidden] (the embedding's when they are tied); logits = h @ W^T."""
    if model.share_embeddings_and_output_weights:
        weight: torch.Tensor = model.shared_embedding_or_output_weight()
        return weight
    if getattr(model.output_layer, "bias", None) is not None:
        raise InvalidArgument("the chunked loss assumes an output layer without bias")
    return model.output_layer.weight  # type: ignore[no-any-return]


def parallel_of(model: Any) -> ModelParallel:
    """The tensor/context-parallel layout `model` was built under (gyre.model.build records it)."""
    mp = getattr(model, "gyre_parallel", None)
    return mp if isinstance(mp, ModelParallel) else NOT_PARALLEL


def batch_layout(batch: PackedBatch) -> TreeLayout:
    """The attention layout of a packed batch: built once per micro-batch and shared by the policy's
    and the reference model's forward, so its flex block mask is built once (TreeLayout caches it)."""
    return TreeLayout(batch.num_tokens, batch.node_offsets, batch.node_lengths, batch.node_parents)


def _next_token_stats(
    model: Any, mp: ModelParallel, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets | hidden) and entropy, chunked; vocabulary-parallel under tensor parallelism."""
    if mp.tp_size > 1:
        return vocab_parallel_logprob_entropy(
            hidden, output_weight(model), targets, chunk_tokens, mp.tp_rank, mp.tp_group
        )
    return chunked_logprob_entropy(hidden, output_weight(model), targets, chunk_tokens)


def _logprobs_entropy_owned(
    model: Any, batch: PackedBatch, chunk_tokens: int, layout: TreeLayout | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log-probs [T], entropies [T] and, under context parallelism, which tokens this CP rank owns
    (None without CP: every token). A token is owned by the rank holding the hidden state that
    predicts it (its predecessor's; its own for a tree's first token), so each token's loss term is
    computed on exactly one CP rank; the other entries are 0."""
    layout = batch_layout(batch) if layout is None else layout
    mp = parallel_of(model)
    device = batch.token_ids.device
    pred = predecessor_index(layout).to(device)
    has = pred >= 0
    num_tokens = batch.num_tokens
    if mp.cp_size == 1:
        hidden = hidden_states(model, batch.token_ids[None], batch.position_ids[None], layout)[0]
        picked, entropy = _next_token_stats(
            model, mp, hidden[pred.clamp(min=0)], batch.token_ids, chunk_tokens
        )
        zero = torch.zeros_like(picked)
        return torch.where(has, picked, zero), torch.where(has, entropy, zero), None
    lo, hi = cp_token_range(num_tokens, mp.cp_size, mp.cp_rank)
    rows = TreeRows(layout, lo, hi)  # this rank's queries against every key

    def gather_kv(_layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_sequence(k, 2, num_tokens, mp), gather_sequence(v, 2, num_tokens, mp)

    hidden = hidden_states(
        model, batch.token_ids[lo:hi][None], batch.position_ids[lo:hi][None], rows, kv_hook=gather_kv
    )[0]
    owner = torch.where(has, pred, torch.arange(num_tokens, device=device))
    owned = (owner >= lo) & (owner < hi)
    idx = owned.nonzero()[:, 0]
    picked, entropy = _next_token_stats(
        model, mp, hidden[owner[idx] - lo], batch.token_ids[idx], chunk_tokens
    )
    logprob_all = picked.new_zeros(num_tokens).index_put((idx,), torch.where(has[idx], picked, 0.0))
    entropy_all = entropy.new_zeros(num_tokens).index_put((idx,), torch.where(has[idx], entropy, 0.0))
    return logprob_all, entropy_all, owned


def batch_logprobs_and_entropy(
    model: Any, batch: PackedBatch, chunk_tokens: int = 4096, layout: TreeLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token_t | ancestors) [T] and the entropy (nats) of p(. | ancestors) [T] under `model`
    (both 0 at a tree's first token, which has no predecessor), fp32 (fp64 for an fp64 model).

    Computed `chunk_tokens` tokens at a time (services.trainer.chunked_softmax): never T x V logits
    at once, forward or backward; equal to the full log-softmax's values and gradients. Under tensor
    parallelism the vocabulary stays split (services.trainer.vocab_parallel) and every TP rank gets
    the same values; under context parallelism a CP rank gets the tokens it owns and 0 elsewhere
    (summed over the CP ranks: the whole batch's)."""
    logprob, entropy, _ = _logprobs_entropy_owned(model, batch, chunk_tokens, layout)
    return logprob, entropy


def batch_logprobs(
    model: Any, batch: PackedBatch, chunk_tokens: int = 4096, layout: TreeLayout | None = None
) -> torch.Tensor:
    """log p(token_t | ancestors) [T] for a packed batch under `model`."""
    return batch_logprobs_and_entropy(model, batch, chunk_tokens, layout)[0]


def tree_loss(
    model: Any, batch: PackedBatch, settings: LossSettings, ref_model: Any | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (a scalar to backpropagate) and metrics of one packed batch (or a shard of one)."""
    if batch.num_tokens == 0:
        zero = sum(p.sum() * 0.0 for p in model.parameters())
        return zero, {"loss": 0.0, "num_tokens": 0.0, "num_trained_tokens": 0.0}
    layout = batch_layout(batch)
    logprobs, entropy, owned = _logprobs_entropy_owned(model, batch, settings.chunk_tokens, layout)
    # Under context parallelism this rank's loss is the terms of the tokens it owns (the CP ranks'
    # losses and gradients add up to the batch's); its metrics count those tokens only.
    mask = batch.loss_mask if owned is None else batch.loss_mask & owned
    per_token, ratio = clipped_token_losses(
        logprobs,
        batch.behaviour_logprobs,
        batch.weight_pos,
        batch.weight_neg,
        mask,
        settings.clip_eps,
        settings.eps_high,
    )
    loss = per_token.sum()
    n_train = int(mask.sum())
    metrics = {
        "num_tokens": float(batch.num_tokens if owned is None else int(owned.sum())),
        "num_trained_tokens": float(n_train),
    }
    if settings.normalise_advantages:
        rms = advantage_rms(batch)
        metrics["advantage_rms"] = rms
        if rms > ADVANTAGE_RMS_FLOOR:  # below it every advantage is ~0: nothing to scale up
            loss = loss / rms
    if settings.kl_coef and ref_model is not None:
        with torch.no_grad():
            # the reference may be held in a narrower dtype (bf16); its log-probs come back in fp32
            ref = batch_logprobs(ref_model, batch, settings.chunk_tokens, layout).to(logprobs.dtype)
        kl = torch.where(mask, k3_kl(logprobs, ref), torch.zeros_like(logprobs))
        loss = loss + settings.kl_coef * (batch.kl_weight * kl).sum()
        metrics["kl_mean"] = float(kl.sum()) / max(n_train, 1)
    if settings.entropy_coef:
        bonus = entropy if settings.entropy_target is None else entropy.clamp(max=settings.entropy_target)
        trained_entropy = torch.where(mask, bonus, torch.zeros_like(entropy))
        loss = loss - settings.entropy_coef * (batch.kl_weight * trained_entropy).sum()
    with torch.no_grad():
        if n_train:
            r = ratio[mask]
            log_r = (logprobs - batch.behaviour_logprobs)[mask]
            metrics["ratio_mean"] = float(r.mean())
            metrics["clip_fraction"] = float(
                ((r < 1.0 - settings.clip_eps) | (r > 1.0 + settings.eps_high)).double().mean()
            )
            metrics["kl_behaviour"] = float(((r - 1.0) - log_r).mean())
            metrics["entropy"] = float(entropy[mask].mean())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
