"""Layer-Cyclic Selective Backpropagation. Knows torch and a list of decoder layers, nothing else.

The recipe's choices import without torch; the engine's names load their modules (and torch) when first asked for.
"""

import importlib

from .choices import IDLE_UPDATES, LR_SCALES, ON_RETURN, SCHEDULES, UPPER_PATHS

_MODULE_OF = {
    "surrogate_agreement": "diagnose",
    "SelectiveLayers": "layers",
    "IdleMomentum": "optim",
    "forget_moments": "optim",
    "gradient_shares": "optim",
    "rate_scales": "optim",
    "BlockSchedule": "schedule",
    "partition": "schedule",
}

__all__ = ["IDLE_UPDATES", "LR_SCALES", "ON_RETURN", "SCHEDULES", "UPPER_PATHS", *_MODULE_OF]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
