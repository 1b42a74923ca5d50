#!/usr/bin/env bash
# GPU readiness check (<= 8 minutes): Megatron model + tree-packed micro-batched training step on
# CUDA (flex attention), NCCL data-parallel resize 1 -> 2 -> 1 when more than one GPU, torch-engine
# decode tokens/s and train tokens/s, a bf16-master step (fp32 master weights; also with ZeRO-1 and
# recompute) with its step time and MFU, and with 2+ GPUs model-level tensor and context
# parallelism (TP=2 and CP=2 on 2 NCCL ranks vs TP=1 on one GPU, same batch and weights, fp32 and
# bf16: max relative loss and gradient gaps, step seconds of each; "skipped" with one GPU), printed
# as one JSON object (scripts/gpu_check.py). The model-parallel section runs last, within what is
# left of the 480 s cap (at most 240 s), and reports a timeout itself instead of being killed.
#
#   scripts/gpu_check.sh               # on a GPU host, from the repository root
#   scripts/gpu_check.sh --allow-cpu   # smoke-test the script itself without a GPU (the
#                                      # model-parallel section on gloo, 2 CPU processes)
#   scripts/gpu_check.sh --xlong       # the trainer step of `gyre bench xlong`'s 1M point (a group
#                                      # of 8 executions of 1M tokens each, ~17M tree tokens)
#   scripts/gpu_check.sh --vllm        # the vLLM section (scripts/vllm_check.py): start two
#                                      # `vllm serve`, generate, reload a version, sleep/wake, migrate
#
# Needs torch with CUDA, megatron-core (a small pure-Python wheel: on a host without network,
# `pip install --no-index megatron_core-*.whl`), pydantic, grpcio, protobuf, safetensors; the vLLM
# section needs the `gpu` extra (`pip install -e .[gpu]`) and transformers.
# CI never runs it. PYTHON selects the interpreter (default: .venv/bin/python if present).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if [ "${1:-}" = "--vllm" ]; then
    shift
    exec timeout 900 "$PYTHON" scripts/vllm_check.py "$@"
fi
if [ "${1:-}" = "--xlong" ]; then
    exec timeout 1200 "$PYTHON" scripts/gpu_check.py "$@"
fi
CAP_S=480
exec timeout "$CAP_S" "$PYTHON" scripts/gpu_check.py --time-cap-s "$CAP_S" "$@"
