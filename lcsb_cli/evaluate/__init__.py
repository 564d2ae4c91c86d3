"""Evaluation of held-out items for every data format (items.py) and `lcsb eval` (run.py)."""

from .items import SUMMARY_KEYS, evaluate_items, predictions_file, silent, summary_row
from .pipeline import run_eval, write_results

__all__ = ["SUMMARY_KEYS", "evaluate_items", "predictions_file", "run_eval", "silent", "summary_row", "write_results"]
