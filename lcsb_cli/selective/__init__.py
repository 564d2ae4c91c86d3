"""Layer-Cyclic Selective Backpropagation. Knows torch and a list of decoder layers, nothing else."""

from .diagnose import surrogate_agreement
from .layers import UPPER_PATHS, SelectiveLayers
from .optim import IDLE_UPDATES, IdleMomentum
from .schedule import SCHEDULES, BlockSchedule, partition

__all__ = ["IDLE_UPDATES", "SCHEDULES", "UPPER_PATHS", "BlockSchedule", "IdleMomentum", "SelectiveLayers", "partition",
           "surrogate_agreement"]
