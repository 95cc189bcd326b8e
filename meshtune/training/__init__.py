"""Training: the loop, the strategy interface it calls, and what every strategy shares (loss, update,
evaluation, optimizers, checkpoints, metrics)."""

# Exit code of a run stopped by a non-finite step (loop.NonFiniteStep); here, without MLX, for the launcher.
NONFINITE_EXIT_CODE = 65  # EX_DATAERR: a step went non-finite; --resume from the last good checkpoint
