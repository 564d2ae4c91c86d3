"""`lcsb bench`: methods side by side in worker processes, and its table."""
