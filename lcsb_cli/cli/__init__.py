"""The `lcsb` command line (app.py: the app and its error handling; verbs.py: the verbs; night.py: `lcsb night`)."""

from . import night  # noqa: F401 - registers `lcsb night`
from .verbs import app

__all__ = ["app"]
