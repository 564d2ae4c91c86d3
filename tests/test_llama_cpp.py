"""The one way the project opens llama.cpp (`lcsb_cli/model/gguf/llama_cpp.py`): extra buffer types off, so hosts whose
AMX kernels fault (ggml-org/llama.cpp#26954) run it, and a child process, so a crash or a hang is an error that names
its cause instead of a dead or stuck pytest worker."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest
from helpers import REPO

from lcsb_cli.model.gguf import llama_cpp
from lcsb_cli.model.load import gguf_source

HELPER = REPO / "lcsb_cli" / "model" / "gguf" / "llama_cpp.py"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return gguf_source("smollm2-135m")


def test_the_helper_opens_models_with_llama_cpps_extra_buffer_types_off(smollm2):
    import llama_cpp as bindings

    llm = llama_cpp.open_llama(smollm2)
    try:
        assert llm.model_params.use_extra_bufts is False
        # the switch is put back: code outside the helper sees llama.cpp's own default
        assert bindings.llama_model_default_params().use_extra_bufts is True
        assert llama_cpp.tokenize(llm, "Hello") == llm.tokenize(b"Hello", add_bos=False, special=True)
    finally:
        llm.close()


def llama_constructions(path: Path) -> list[int]:
    """Lines of `path` that name llama-cpp-python's Llama class (an import of it or `llama_cpp.Llama`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        imported = isinstance(node, ast.ImportFrom) and node.module == "llama_cpp"
        if imported and any(alias.name == "Llama" for alias in node.names):
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "Llama" and getattr(node.value, "id", "") == "llama_cpp":
            lines.append(node.lineno)
    return lines


def test_no_code_but_the_helper_opens_a_llama_cpp_model():
    folders = ("lcsb_cli", "tests", "scripts", "tools", "experiments")
    sources = [path for folder in folders for path in (REPO / folder).rglob("*.py")]
    assert llama_constructions(HELPER), "the scan must see the helper's own import"
    found = {str(path.relative_to(REPO)): llama_constructions(path) for path in sources if path != HELPER}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_crash_of_llama_cpp_is_an_error_naming_the_signal(smollm2):
    with llama_cpp.LlamaCpp(smollm2) as llm:
        ids = llm.tokenize("The capital of France is")
        assert llm.greedy(ids, 2) == llm.greedy(ids, 2)
        os.kill(llm.pid, signal.SIGILL)
        with pytest.raises(llama_cpp.LlamaCppCrashed, match=r"SmolLM2.*died of SIGILL.*llama\.cpp#26954"):
            llm.logits(ids)


def test_a_llama_cpp_that_stops_answering_is_killed_after_its_timeout(smollm2):
    with llama_cpp.LlamaCpp(smollm2, timeout_s=3) as llm:
        os.kill(llm.pid, signal.SIGSTOP)
        with pytest.raises(llama_cpp.LlamaCppCrashed, match="no answer in 3 s; the process was killed"):
            llm.tokenize("Hello")


def test_a_file_llama_cpp_refuses_is_its_error_not_a_crash(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(llama_cpp.LlamaCppError, match="not-a-model.gguf: ValueError") as refused:
        llama_cpp.LlamaCpp(bad)
    assert not isinstance(refused.value, llama_cpp.LlamaCppCrashed)
