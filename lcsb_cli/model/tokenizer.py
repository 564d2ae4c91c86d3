"""The tokenizer of a base model directory, and one shared by every load inside `shared_tokenizers`."""

from __future__ import annotations

import contextlib
from pathlib import Path

# the tokenizers loaded inside `shared_tokenizers`, by directory; None outside it
_SHARED_TOKENIZERS: dict[Path, object] | None = None


def load_tokenizer(path: Path):
    """The tokenizer of `path`; inside `shared_tokenizers` the one loaded there before, if any."""
    from transformers import AutoTokenizer

    key = Path(path).resolve()
    if _SHARED_TOKENIZERS is not None and key in _SHARED_TOKENIZERS:
        return _SHARED_TOKENIZERS[key]
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if _SHARED_TOKENIZERS is not None:
        _SHARED_TOKENIZERS[key] = tokenizer
    return tokenizer


@contextlib.contextmanager
def shared_tokenizers():
    """Every load of one tokenizer inside the block returns the same object. A per-user run loads its base once a
    user, and each fast tokenizer that encodes leaves about 70 KB in the tokenizers library after it is freed
    (lamp-tiny, one user's items); among the next user's large blocks those bytes pinned a growing share of the heap."""
    global _SHARED_TOKENIZERS
    outer = _SHARED_TOKENIZERS
    _SHARED_TOKENIZERS = {} if outer is None else outer
    try:
        yield
    finally:
        _SHARED_TOKENIZERS = outer
