"""Optimizers whose state lives on the host."""

from ooc.optim.host_adamw import HostAdamW, HostMemoryError

__all__ = ["HostAdamW", "HostMemoryError"]
