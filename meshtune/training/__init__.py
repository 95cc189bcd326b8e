"""One process's training: the loop and its compiled step, losses, optimizers, checkpoints and metrics."""
