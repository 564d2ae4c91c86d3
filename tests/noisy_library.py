"""A stand-in third-party library that talks the way lcsb's dependencies do, for the tests that hold lcsb's stderr
to its own lines: at import it logs a WARNING through a terminal handler of its own (as transformers, datasets and
huggingface_hub attach one) and one through the root logger (as kernels and bitsandbytes do), and raises a Python
warning; while a model loads (transformers' AutoConfig.from_pretrained) it logs and warns again."""

from __future__ import annotations

import itertools
import logging
import warnings

IMPORTS = itertools.count()
MARK = "noisy-library"


def import_library() -> None:
    """What a fresh import of the library does (each call under a new logger name, as a fresh process would)."""
    name = f"noisy{next(IMPORTS)}"
    own = logging.getLogger(name)
    own.addHandler(logging.StreamHandler())
    own.propagate = False
    own.warning(f"{MARK}: an import-time warning through the library's own handler")
    logging.getLogger(f"{name}.kernels").warning(f"{MARK}: an import-time warning through the root logger")
    warnings.warn(f"{MARK}: an import-time Python warning", UserWarning, stacklevel=1)


def noisy_from_pretrained(original):
    def from_pretrained(*args, **kwargs):
        logging.getLogger("noisy.loading").warning(f"{MARK}: a warning while the model loads")
        warnings.warn(f"{MARK}: a Python warning while the model loads", UserWarning, stacklevel=1)
        return original(*args, **kwargs)

    return from_pretrained


def install() -> None:
    """The library in a fresh `python -m lcsb_cli`-like process: imported after lcsb, patched into model loading."""
    import transformers

    import_library()
    transformers.AutoConfig.from_pretrained = noisy_from_pretrained(transformers.AutoConfig.from_pretrained)
