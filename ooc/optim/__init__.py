"""Optimizers whose state lives on the host."""

from ooc.optim.host_adamw import HostAdamW, HostMemoryError
from ooc.optim.loss_scale import LossScale
from ooc.optim.pipeline import UncommittedStepWarning
from ooc.optim.stages import Stage

__all__ = ["HostAdamW", "HostMemoryError", "LossScale", "Stage", "UncommittedStepWarning"]
