"""The `lcsb` command line (app.py: the app and its error handling; verbs.py: the verbs; night.py: `lcsb night`).
The entry point: importing it installs the process settings (runtime.install) before any third-party import."""

from ..runtime import install

install()

from . import night  # noqa: E402, F401 - registers `lcsb night`
from .verbs import app  # noqa: E402

__all__ = ["app"]
