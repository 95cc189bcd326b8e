"""Runs stock mlx_lm.lora's own training code and prints its report windows as JSON.

Started as a subprocess by `meshtune bench peer`. It follows `mlx_lm.lora.run`
(load, datasets, `train_model`) and only adds a callback that records what stock
reports; nothing of meshtune is imported, so the peer runs exactly as shipped.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np


def main(argv: list[str]) -> int:
    opts = json.loads(argv[0])
    import mlx_lm.lora as lora
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import load

    windows: list[dict] = []

    class Record(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            windows.append(dict(info))

    args = dict(lora.CONFIG_DEFAULTS)
    args.update(opts)
    args = types.SimpleNamespace(**args)
    np.random.seed(args.seed)
    model, tokenizer = load(args.model)
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    lora.train_model(args, model, train_set, valid_set, training_callback=Record())
    print("STOCK_RESULT " + json.dumps(windows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
