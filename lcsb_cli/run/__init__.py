"""One training run: the loop and its hooks, the trainer, checkpoints and resume, the run dir, job control,
per-user fan-out and the torch.distributed world."""
