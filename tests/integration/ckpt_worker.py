"""Saves checkpoints in a loop until killed; tests/*/test_checkpoint.py SIGKILLs it mid-save.

    python tests/integration/ckpt_worker.py RUN_DIR

Each checkpoint's arrays are filled with its step, so a loaded checkpoint can be
checked for belonging to the step its folder names.
"""

import sys
from pathlib import Path

import mlx.core as mx

from meshtune.training.checkpoint import TrainingState, resumable_checkpoint, save_checkpoint

run = Path(sys.argv[1])
found = resumable_checkpoint(run, say=lambda line: None)
step = int(found.name) if found else 0
print("ready", flush=True)
while True:
    step += 1
    fill = float(step)
    trainable = {"a": mx.full((512, 1024), fill), "b": mx.full((256,), fill)}
    optimizer = {"m": {"a": mx.full((512, 1024), fill)}, "step": mx.array(step)}
    save_checkpoint(run, state=TrainingState(step=step, data_cursor={"epoch": 0, "position": step}),
                    trainable=trainable, optimizer_state=optimizer, config={"step": step}, keep=3)
    print(f"saved {step}", flush=True)
