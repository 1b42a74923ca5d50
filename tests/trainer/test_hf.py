"""HF interop: a tiny random Llama / Qwen2 built locally (no download) imports with equal logits, and exports back
exactly; examples/hf_model.yaml trains such a checkpoint with real services and exports it back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.model import causal_logits
from services.trainer.hf import export_hf, import_hf


def _tiny(kind: str, tie: bool):
    import transformers

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=5000.0))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_imported_hf_model_gives_the_same_logits_and_exports_back_exactly(tmp_path, kind, tie):
    import transformers

    hf = _tiny(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        got = causal_logits(ours, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    export_hf(ours, tmp_path / "out")
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    back = cls.from_pretrained(tmp_path / "out")
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_initial_weights_from_a_checkpoint_that_does_not_fit_the_model_section_are_refused(tmp_path):
    from gyre.errors import InvalidArgument
    from gyre.model import ModelConfig, build_model
    from gyre.model.hf import load_initial_weights, read_hf_config

    _tiny("llama", False).save_pretrained(tmp_path / "hf")
    fits = read_hf_config(tmp_path / "hf")
    model = build_model(
        fits.model_copy(update={"init_std": 0.5}), device="cpu"
    )  # init_std is not architecture
    load_initial_weights(model, tmp_path / "hf")
    torch.testing.assert_close(
        causal_logits(model, torch.arange(9)[None]),
        causal_logits(import_hf(tmp_path / "hf"), torch.arange(9)[None]),
    )

    wrong = build_model(
        ModelConfig.model_validate({**fits.model_dump(), "ffn_hidden_size": 64}), device="cpu"
    )
    with pytest.raises(InvalidArgument, match="ffn_hidden_size: config 64 vs checkpoint 96.*model-config"):
        load_initial_weights(wrong, tmp_path / "hf")
    with pytest.raises(InvalidArgument, match="do not exist"):
        load_initial_weights(wrong, tmp_path / "nowhere")


# --- examples/hf_model.yaml end to end ---------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.slow
def test_hf_model_yaml_trains_two_steps_from_the_checkpoint_and_exports_back_to_transformers(
    tmp_path, nats_url
):
    """`gyre run examples/hf_model.yaml` with real services, from the project's tiny Qwen2 checkpoint
    and its own tokenizer (services.trainer.hf.write_tiny_qwen2), written by this test.

    Shows: every service tokenised with the checkpoint's tokenizer (the prompts are its chat template,
    not byte ids); the rollout served the checkpoint as version 0 (the log-probs it recorded equal the
    `transformers` model's), the trainer started from it (version 1 is one small step away from it,
    not a random init), two steps were trained, and version 2 exported as an HF checkpoint loads
    back into `transformers` with logits within 1e-4 of Gyre's model on the same weights.
    """
    import transformers

    from app.job.eventlog import read_events
    from gyre.bus import subjects
    from gyre.model import build_model, load_weights
    from gyre.model.hf import read_hf_config
    from gyre.v1 import events_pb2
    from services.trainer.hf import export_weights, write_tiny_qwen2
    from tests.helpers.stream import read_stream

    ckpt = write_tiny_qwen2(tmp_path / "tiny-qwen2")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        GYRE_NATS_URL=nats_url,  # the session's server: the step events outlive the run
        GYRE_RUN_ID=f"hf-{tmp_path.name}"[:60].replace("_", "-"),
        GYRE_TRAINER__INIT_WEIGHTS=str(ckpt),
        GYRE_ROLLOUT__INIT_WEIGHTS=str(ckpt),
        GYRE_TRAINER__TOKENIZER=str(ckpt),
        GYRE_ROLLOUT__TOKENIZER=str(ckpt),
        GYRE_TRAJECTORY__TOKENIZER=str(ckpt),
    )
    proc = subprocess.run(
        [
            *(sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"),
            *("run", "examples/hf_model.yaml", "--run-dir", str(run_dir)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    cfg = read_hf_config(ckpt)

    # the rollout served the checkpoint: a version-0 call's log-probs are the HF model's
    num_steps = sum(1 for r in read_events(run_dir / "events.jsonl") if r["type"] == "StepEvent")
    run_id = env["GYRE_RUN_ID"]
    steps = read_stream(nats_url, subjects.steps(run_id, "*"), events_pb2.StepEvent, num_steps)
    v0 = [s for s in steps if set(s.completion_versions) == {0}]
    assert v0, "no call was served by version 0"
    step = v0[0]
    prompt, completion = list(step.prompt_token_ids), list(step.completion_token_ids)
    rendered = hf_tok.decode(prompt)
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
    assert max(prompt) >= 512  # BPE ids, not bytes
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0].double()
    expected = [
        float(torch.log_softmax(logits[len(prompt) - 1 + i], -1)[t]) for i, t in enumerate(completion)
    ]
    got = list(step.completion_logprobs)
    assert got == pytest.approx(expected, abs=1e-4)
    gap = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(f"v0 call {step.event_id}: max |logprob - transformers| = {gap:.2e}")

    # the trainer started from the checkpoint: version 1 is one AdamW step (lr 1e-3) away from it
    v1 = build_model(cfg, device="cpu", dtype=torch.float32)
    load_weights(v1, run_dir / "weights" / "v000001.safetensors")
    start = import_hf(ckpt)
    mine, theirs = v1.state_dict(), start.state_dict()
    drift = max(float((mine[k] - theirs[k]).abs().max()) for k in mine if not k.endswith("_extra_state"))
    assert 0 < drift < 0.01, drift
    print(f"max |v1 - checkpoint| = {drift:.2e} (one AdamW step, lr 1e-3)")

    # version 2, exported, loads into transformers with the same logits as our model
    v2_path = run_dir / "weights" / "v000002.safetensors"
    out = export_weights(v2_path, cfg, tmp_path / "hf-v2")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = build_model(cfg, device="cpu", dtype=torch.float32)
    load_weights(ours, v2_path)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = back(ids).logits
        mine = causal_logits(ours, ids)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    print(f"v2 exported: max |gyre logits - transformers logits| = {float((mine - theirs).abs().max()):.2e}")
    assert not torch.equal(back.lm_head.weight, hf.lm_head.weight), "version 2 did not train"
