"""vLLM readiness check (run by `scripts/gpu_check.sh --vllm`): prints one JSON object.

On a GPU host with vLLM (`pip install -e .[gpu]`), through Gyre's own code paths
(services/rollout/engines/vllm_server.py, vllm_engine.py, vllm_worker.py):

    1. start: two `vllm serve` processes started and health-waited by VLLMServers (two GPUs if the
       host has them, else both on GPU 0 at `--gpu-memory-utilization` each)
    2. generate: a greedy completion streamed as token ids, compared with transformers' greedy
       decoding of the same checkpoint (fraction of equal tokens; bf16 kernels may differ late)
    3. reload: a Megatron-named version published as the trainer does, loaded by the worker
       extension; the greedy tokens then follow transformers on the new weights
    4. sleep/wake: the engine closes (level-2 sleep); the GPU memory given back, measured with
       torch.cuda.mem_get_info; a new engine wakes the server and answers the same tokens again
    5. migrate: a long greedy request drained from server A after some streamed tokens ends on B;
       its token ids compared with the unmigrated request's

`--command "python -m tests.helpers.fake_vllm serve" --allow-cpu` runs the same script against the
test fake (tests/helpers/fake_vllm.py) on a machine without a GPU: a smoke test of the script
itself (tests/rollout/test_vllm_check_script.py); its numbers say nothing about vLLM.

    python scripts/vllm_check.py --write-checkpoint DIR

writes the tiny checkpoint real vLLM serves on a CPU (`write_tiny_checkpoint`; `make run-vllm` and
tests/rollout/test_vllm_real.py use it) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.rollout.engines.base import GenerationRequest, Sampling  # noqa: E402
from services.rollout.engines.vllm_engine import VLLMEngine  # noqa: E402
from services.rollout.engines.vllm_server import VLLMServers  # noqa: E402
from services.rollout.router import Router  # noqa: E402

PROMPT = [1, 5, 9, 14, 3, 7, 11, 2]


def request(rid: str, max_tokens: int) -> GenerationRequest:
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, seed=0, stop_token_ids=())
    return GenerationRequest(rid, PROMPT, sampling, execution_id=rid)


def publish(model_dir: Path, store: Path, version: int, scale: float) -> Any:
    """Version `version` as the trainer writes it: Megatron names, safetensors, sha256."""
    from gyre.model.hf import import_hf
    from gyre.model.weights import save_weights
    from gyre.v1 import common_pb2

    model = import_hf(model_dir)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(version)
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    path = store / f"v{version:06d}.safetensors"
    digest = save_weights(model, path)
    return common_pb2.WeightVersion(version=version, uri=path.resolve().as_uri(), sha256=digest)


def write_tiny_checkpoint(out: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 with the project's BPE tokenizer (as `python -m services.trainer.hf
    tiny-qwen2` writes) that vLLM's CPU attention serves: head_dim 64 (hidden 128, 2 heads, 1 KV head;
    the CPU attention refuses the 16 of the usual tiny checkpoint), 2 layers, 1024 positions, fp32."""
    import transformers

    from gyre.tokenizers.bpe import write_generation_config, write_tiny_tokenizer

    num_ids = write_tiny_tokenizer(out)
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=-(-num_ids // 64) * 64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="float32",
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    write_generation_config(out)  # the model's save replaced it
    return out


def reference_greedy(model_dir: Path, max_tokens: int, weights: Any = None) -> list[int]:
    """transformers' greedy decoding of PROMPT (fp32, CPU), on the checkpoint or a published version."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if weights is not None:
        from safetensors.torch import load_file

        from gyre.model.hf import megatron_to_hf, read_hf_config

        state = megatron_to_hf(load_file(weights.uri.removeprefix("file://")), read_hf_config(model_dir))
        hf.load_state_dict(state, strict=False)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return [int(t) for t in out[0, len(PROMPT) :]]


def agreement(a: list[int], b: list[int]) -> dict[str, Any]:
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return {"equal_fraction": same / max(1, len(b)), "first_difference": first_diff, "length": len(a)}


def free_gpu_bytes(cuda: bool) -> int | None:
    return int(torch.cuda.mem_get_info(0)[0]) if cuda else None


async def run(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cuda": cuda, "command": args.command}
    if args.model:
        model_dir = Path(args.model)
    else:
        from tests.helpers.tiny_hf import tiny_qwen2_dir

        model_dir = tiny_qwen2_dir()
    two_gpus = cuda and torch.cuda.device_count() > 1
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "weights"
        store.mkdir()
        servers = VLLMServers.for_devices(
            ["gpu-a", "gpu-b"],
            model=model_dir,
            weights_store=store,
            log_dir=Path(tmp) / "logs",
            command=tuple(shlex.split(args.command)),
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            extra_args=("--enforce-eager",) if args.enforce_eager else (),
            start_timeout_s=args.start_timeout_s,
        )
        if not two_gpus:  # both servers on the one GPU (for_devices would give B GPU 1)
            for server in servers.servers.values():
                server.spec = type(server.spec)(**{**server.spec.__dict__, "gpus": (0,)})
        t0 = time.perf_counter()
        await servers.start()
        out["start"] = {
            "servers": 2,
            "seconds": time.perf_counter() - t0,
            "gpus": "2" if two_gpus else "1 (shared)",
        }
        key = servers.spec("gpu-a").api_key

        def engine(name: str, device: str, **kw: Any) -> VLLMEngine:
            return VLLMEngine(name, device, servers.spec(device).url, api_key=key, start_timeout_s=120, **kw)

        try:
            a = engine("a0", "gpu-a")
            await a.start()
            n = args.max_tokens
            base = await a.generate(request("g0", n))
            out["generate"] = {
                "tokens": len(base.token_ids),
                "logprobs_finite": all(lp == lp for lp in base.logprobs),
                **agreement(base.token_ids, reference_greedy(model_dir, n)),
            }

            v1 = publish(model_dir, store, 1, args.perturb)
            t1 = time.perf_counter()
            await a.load_weights(v1)
            after = await a.generate(request("g1", n))
            out["reload"] = {
                "seconds": time.perf_counter() - t1,
                "version": a.weight_version,
                "tokens_changed": after.token_ids != base.token_ids,
                **agreement(after.token_ids, reference_greedy(model_dir, n, v1)),
            }

            awake = free_gpu_bytes(cuda)
            await a.close()  # level-2 sleep: the device is lent to training
            asleep = free_gpu_bytes(cuda)
            back = engine("a1", "gpu-a", initial_weights=v1)
            await back.start()
            again = await back.generate(request("g2", n))
            out["sleep_wake"] = {
                "freed_gib": None if awake is None or asleep is None else (asleep - awake) / 2**30,
                "same_tokens_after_wake": again.token_ids == after.token_ids,
                "version_after_wake": back.weight_version,
            }

            long_n = args.migrate_tokens
            unmoved = await back.generate(request("m0", long_n))
            b = engine("b0", "gpu-b", initial_weights=v1)
            await b.start()
            router = Router()
            await router.add_engine(back)
            pending = asyncio.create_task(router.generate(request("m1", long_n)))
            start_tokens = back.tokens_generated
            while back.tokens_generated - start_tokens < args.drain_after and not pending.done():  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            await router.add_engine(b)
            await router.remove_engine(back.device_id)
            moved = await pending
            out["migrate"] = {
                "migrations": moved.num_migrations,
                "engines": moved.engine_ids,
                "token_exact": moved.token_ids == unmoved.token_ids,
                **agreement(moved.token_ids, unmoved.token_ids),
            }
            await b.close()
        finally:
            servers.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--command", default="vllm serve", help="how to start a server (default: vllm serve)")
    parser.add_argument("--model", default="", help="an HF checkpoint directory (default: a tiny Qwen2)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (with the fake only)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--migrate-tokens", type=int, default=512)
    parser.add_argument("--drain-after", type=int, default=16, help="streamed tokens before the drain")
    parser.add_argument("--perturb", type=float, default=0.05, help="noise scale of the published version")
    parser.add_argument(
        "--write-checkpoint", type=Path, metavar="DIR", help="write the tiny CPU-servable checkpoint and exit"
    )
    args = parser.parse_args()
    if args.write_checkpoint is not None:
        print(f"wrote {write_tiny_checkpoint(args.write_checkpoint)}")
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(json.dumps({"error": "no CUDA device (use --allow-cpu with the fake to test the script)"}))
        return 2
    result = asyncio.run(run(args, cuda))
    print(json.dumps(result, indent=2))
    ok = (
        result["reload"]["version"] == 1
        and result["sleep_wake"]["same_tokens_after_wake"]
        and result["migrate"]["migrations"] == 1
        and result["migrate"]["token_exact"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
