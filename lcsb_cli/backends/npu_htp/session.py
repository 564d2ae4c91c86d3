"""onnxruntime sessions on Qualcomm's HTP backend (QNN execution provider), compiled once and cached.

CPU fallback is always disabled: a node HTP refuses fails the session instead of running on the CPU. A
compiled graph is kept as onnxruntime's EPContext model (the QNN context binary embedded) under
`$LCSB_CACHE/htp/`, keyed by the graph's bytes, the provider options and the library versions, so the next
run loads it without compiling.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime_qnn

from ...paths import cache_root


class HtpError(RuntimeError):
    """A product HTP could not run (compile or execution), naming its layer."""


@functools.cache
def qnn_devices() -> list:
    # errors only: the provider's start-up warnings are about other platforms
    ort.set_default_logger_severity(3)
    ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        raise HtpError("onnxruntime-qnn registered no QNN device")
    return devices


def provider_options(htp_arch: int, soc_model: int) -> dict[str, str]:
    """One set of options for every session of a process: sessions opened with different options (say, the fp16
    ones' soc_model) make the others' later runs fail with QNN_COMMON_ERROR_GENERAL. enable_htp_fp16_precision
    runs float graphs at fp16 (which needs soc_model) and leaves quantized graphs as they are."""
    return {
        "backend_type": "htp",
        "htp_arch": str(htp_arch),
        "soc_model": str(soc_model),
        "enable_htp_fp16_precision": "1",
    }


def _session_options(provider: dict[str, str], context_path: Path | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context_path is not None:
        options.add_session_config_entry("ep.context_enable", "1")
        options.add_session_config_entry("ep.context_file_path", str(context_path))
        options.add_session_config_entry("ep.context_embed_mode", "1")
    options.add_provider_for_devices(qnn_devices(), provider)
    return options


class HtpGraph:
    """One compiled product graph of fixed row count; `run` pads and splits any number of rows into it."""

    def __init__(self, name: str, model: onnx.ModelProto, provider: dict[str, str]):
        self.name, self.provider = name, provider
        self.model_bytes = model.SerializeToString()
        self.rows = model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
        versions = {"ort": ort.__version__, "qnn": onnxruntime_qnn.__version__, "provider": provider}
        key = hashlib.sha256(self.model_bytes + json.dumps(versions, sort_keys=True).encode()).hexdigest()[:32]
        self.context_path = cache_root() / "htp" / f"{key}_ctx.onnx"
        self.session = self._open()

    def _open(self) -> ort.InferenceSession:
        try:
            if self.context_path.is_file():
                session = ort.InferenceSession(str(self.context_path), _session_options(self.provider))
            else:
                session = self._compile()
            # onnxruntime's own retry on the CPU provider: never
            session.disable_fallback()
            return session
        # onnxruntime raises its own Fail/RuntimeException types
        except Exception as exc:
            raise HtpError(f"{self.name}: HTP did not take the graph ({str(exc).splitlines()[0]})") from exc

    def _compile(self) -> ort.InferenceSession:
        """Compile, and keep the EPContext model: written under a temporary name, then renamed into place."""
        self.context_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix="_ctx.onnx", dir=self.context_path.parent)
        os.close(fd)
        # onnxruntime refuses to overwrite an existing context file
        os.unlink(tmp)
        try:
            session = ort.InferenceSession(self.model_bytes, _session_options(self.provider, Path(tmp)))
            os.replace(tmp, self.context_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return session

    def run(self, rows: np.ndarray) -> np.ndarray:
        """All rows through the graph, `self.rows` at a time (the last block zero-padded); a failed run rebuilds
        the session and retries once, then raises HtpError."""
        count = rows.shape[0]
        padded = np.zeros((-(-count // self.rows) * self.rows, rows.shape[1]), np.float32)
        padded[:count] = rows
        blocks = [self._run_block(padded[start : start + self.rows]) for start in range(0, len(padded), self.rows)]
        return np.concatenate(blocks)[:count]

    def _run_block(self, block: np.ndarray) -> np.ndarray:
        try:
            return self.session.run(None, {"A": block})[0]
        except Exception:
            self.session = self._open()
        try:
            return self.session.run(None, {"A": block})[0]
        except Exception as exc:
            raise HtpError(f"{self.name}: HTP failed the product twice ({str(exc).splitlines()[0]})") from exc
