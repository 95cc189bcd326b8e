"""Training: the loop, the strategy interface it calls, and what every strategy shares (loss, update,
evaluation, optimizers, checkpoints, metrics)."""
