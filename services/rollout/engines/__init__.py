"""Inference engines behind one interface (base.Engine): torch (gyre.model) and vLLM (external server)."""

from .base import Completion, Engine, EngineState, GenerationRequest, Sampling

__all__ = ["Completion", "Engine", "EngineState", "GenerationRequest", "Sampling"]
