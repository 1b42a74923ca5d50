"""Environments behind one async interface (see base.py) and the task families that make them."""

from .base import Action, Environment, Progress, StepResult, TaskFamily

__all__ = ["Action", "Environment", "Progress", "StepResult", "TaskFamily"]
