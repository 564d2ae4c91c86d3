"""lcsb: LoRA fine-tuning of causal LLMs with layer-cyclic selective backprop."""

import warnings as _warnings

from . import runtime as _runtime

# before any third-party import: environment knobs, no hub kernels, stderr owned by lcsb
_runtime.install()
_warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\b")
# MeZO steps no optimizer, yet the LR schedule must advance: torch's ordering warning does not apply.
_warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
