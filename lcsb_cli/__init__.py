"""lcsb: LoRA fine-tuning of causal LLMs with layer-cyclic selective backprop."""

import logging as _logging
import os as _os
import warnings as _warnings

# Library chatter (download progress bars, deprecation notices of calls made inside peft) would drown the run's
# own display.
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# OpenMP threads that spin between parallel regions starve bitsandbytes' CPU kernels and the Python between them
# (the 4-bit 0.5B step took 15-49 s spinning); passive waiting sleeps instead. Read when torch loads OpenMP.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bitsandbytes wraps its default kernels in torch.compile at import, which loads torch._inductor's compiler (41 MiB
# of RSS, measured); lcsb compiles nothing, and with dynamo disabled those wrappers run the plain functions.
_os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# bitsandbytes' note, on every CPU run with AVX512-BF16, about an optional hub kernel we must not fetch; its other
# warnings stay.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community"))
_warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\b")
# MeZO steps no optimizer, yet the LR schedule must advance: torch's ordering warning does not apply.
_warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
