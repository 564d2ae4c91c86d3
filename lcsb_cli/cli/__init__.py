"""The `lcsb` command line (app.py: the app and its error handling; verbs.py: the verbs)."""

from .verbs import app

__all__ = ["app"]
