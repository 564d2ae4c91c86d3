"""Process-wide settings. `import lcsb_cli` sets the first two, before any third-party import (`guard_imports`); the
`lcsb` entry point (cli/) adds the third and the warning filters (`install`), which a library import leaves alone.

- Library knobs that are read from the environment at import time.
- No code from the network: transformers' hub kernels are switched off, and the `kernels` package (which
  bitsandbytes calls directly on CPUs with AVX512-BF16) cannot be imported, so nothing fetches and runs kernel
  code the user did not install.
- lcsb owns stderr: third-party log records and Python warnings go to the run's log file (or nowhere before a
  run directory exists); `--verbose` shows them on stderr too. Output a library writes to stderr itself (a progress
  bar) is made into records where lcsb calls it (`stderr_to_log`). Libraries that attach their own terminal handler
  (transformers, datasets, huggingface_hub) are kept from doing so.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path

# in a run directory
LOG_FILE = "lcsb.log"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _set_library_knobs() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # OpenMP threads that spin between parallel regions starve bitsandbytes' CPU kernels and the Python between
    # them (the 4-bit 0.5B step took 15-49 s spinning); passive waiting sleeps instead. Read when torch loads OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # bitsandbytes wraps its default kernels in torch.compile at import, which loads torch._inductor's compiler
    # (41 MiB of RSS, measured); lcsb compiles nothing, and with dynamo disabled those wrappers run plain functions.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _block_hub_kernels() -> None:
    """transformers' switch for its hub kernels, and no `kernels` module at all: bitsandbytes' CPU backend calls
    `kernels.get_kernel(...)` itself, which downloads from the hub and imports what it got."""
    os.environ["USE_HUB_KERNELS"] = "NO"
    if sys.modules.get("kernels") is None:
        # the import system's own "not importable" marker
        sys.modules["kernels"] = None


class _LibraryLogger(logging.Logger):
    """The logger class of every library: it may not attach a handler that writes to the terminal, and its records
    always propagate to the root, where lcsb decides where they go."""

    def addHandler(self, handler: logging.Handler) -> None:
        if not _writes_to_terminal(handler):
            super().addHandler(handler)

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass


def _writes_to_terminal(handler: logging.Handler) -> bool:
    return type(handler) is logging.StreamHandler and handler.stream in (
        sys.stderr,
        sys.stdout,
        sys.__stderr__,
        sys.__stdout__,
    )


def _adopt_existing_loggers() -> None:
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if type(logger) is logging.Logger:
            for handler in [h for h in logger.handlers if _writes_to_terminal(h)]:
                logger.removeHandler(handler)
            logger.__class__ = _LibraryLogger


class ThirdPartyRecords(logging.Handler):
    """The root handler: every record goes to the run's log file once one is attached (those from before are
    kept until then, a bounded number), and to stderr with --verbose."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.verbose = False
        self.file = None
        self.pending: collections.deque[str] = collections.deque(maxlen=2000)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if self.verbose:
                sys.stderr.write(line + "\n")
            if self.file is not None:
                self.file.write(line + "\n")
                self.file.flush()
            else:
                self.pending.append(line)
        except Exception:
            self.handleError(record)

    def attach(self, path: Path | None) -> Path | None:
        """Write to `path` from now on (None: hold nothing, write nowhere); returns the path written before."""
        previous = None if self.file is None else Path(self.file.name)
        if self.file is not None:
            self.file.close()
        self.file = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        if self.file is not None:
            self.file.writelines(line + "\n" for line in self.pending)
            self.file.flush()
        self.pending.clear()
        return previous


RECORDS = ThirdPartyRecords()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Python warnings: lcsb's own (raised in its package) on stderr as one line; every other to the log."""
    if str(filename).startswith(PACKAGE_DIR):
        sys.stderr.write(f"warning: {message}\n")
        return
    logging.getLogger("py.warnings").warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)


def _own_stderr() -> None:
    logging.setLoggerClass(_LibraryLogger)
    _adopt_existing_loggers()
    root = logging.getLogger()
    if RECORDS not in root.handlers:
        root.addHandler(RECORDS)
    root.setLevel(logging.INFO)
    warnings.showwarning = _show_warning


def set_verbose(verbose: bool) -> None:
    """Show records on stderr from now on, and those held since start-up (before the flag was parsed)."""
    if verbose and not RECORDS.verbose:
        sys.stderr.writelines(line + "\n" for line in RECORDS.pending)
    RECORDS.verbose = verbose


def log_to(path: Path | None) -> None:
    """Send third-party records to `path` (appended; the ones held since the last call first), or, with None,
    stop writing and drop what is held."""
    RECORDS.attach(path)


@contextlib.contextmanager
def logging_into(path: Path):
    """log_to(path) for a block, then back to the file written before (an eval inside a training run)."""
    previous = RECORDS.attach(path)
    try:
        yield
    finally:
        RECORDS.attach(previous)


@contextlib.contextmanager
def stderr_to_log(name: str):
    """What a library writes straight to stderr during the block (a tqdm progress bar, which is not a log record)
    becomes INFO records of the logger `stderr.<name>` (outside the library's own logger, whose level may drop
    INFO), one per line as last drawn; with --verbose it stays on stderr."""
    if RECORDS.verbose:
        yield
        return
    text = io.StringIO()
    try:
        with contextlib.redirect_stderr(text):
            yield
    finally:
        for line in text.getvalue().split("\n"):
            # a bar redraws its line after each carriage return: the last drawing is the final state
            drawn = next((part.strip() for part in reversed(line.split("\r")) if part.strip()), None)
            if drawn:
                logging.getLogger(f"stderr.{name}").info(drawn)


def _quiet_known_warnings() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\b")
    # MeZO steps no optimizer, yet the LR schedule must advance: torch's ordering warning does not apply.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


def guard_imports() -> None:
    _set_library_knobs()
    _block_hub_kernels()


def install() -> None:
    """The CLI's process: lcsb owns stderr and quiets known warnings. Idempotent: the entry point calls it on import,
    and a test session or a script that wants the CLI's process may too."""
    guard_imports()
    _own_stderr()
    _quiet_known_warnings()
