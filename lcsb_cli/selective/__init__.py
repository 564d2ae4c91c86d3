"""Layer-Cyclic Selective Backpropagation. Knows torch and a list of decoder layers, nothing else."""

from .layers import SelectiveLayers
from .optim import IdleMomentum
from .schedule import BlockSchedule, partition

__all__ = ["BlockSchedule", "IdleMomentum", "SelectiveLayers", "partition"]
