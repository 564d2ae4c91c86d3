"""lcsb: LoRA fine-tuning of causal LLMs with layer-cyclic selective backprop."""

from . import runtime as _runtime

# before any third-party import: environment knobs, and no code from the network (bitsandbytes fetches kernels at
# import otherwise); logging and warnings stay the caller's until the `lcsb` entry point takes them (cli/)
_runtime.guard_imports()
