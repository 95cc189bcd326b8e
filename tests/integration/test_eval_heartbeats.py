"""Evaluation keeps a run's watchdog fed: each validation and test batch tells it the rank is alive,
so a long evaluation is not taken for a lost rank (runtime/watchdog.py)."""

from __future__ import annotations

import meshtune.api as api
from meshtune.config import Config
from meshtune.runtime.watchdog import Watchdog
from meshtune.training.metrics import Reporter


def test_every_validation_and_test_batch_tells_the_watchdog_the_rank_is_alive(tmp_path, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(Watchdog, "alive", lambda self: events.append("alive"))
    plain_eval = Reporter.eval

    def recorded_eval(self, step, *, split, **kw):
        events.append(split)
        return plain_eval(self, step, split=split, **kw)

    monkeypatch.setattr(Reporter, "eval", recorded_eval)
    cfg = Config.from_dict({"train": {"iters": 2, "batch_size": 2, "val_batches": 2, "steps_per_eval": 2,
                                      "test": True, "test_batches": 3},
                            "output": {"adapter_path": str(tmp_path / "run")}})
    api.finetune(cfg, log=lambda _line: None, show_progress=False)
    # validation at step 0 and at the end, then the test split, each after its batches' heartbeats
    assert events == ["alive"] * 2 + ["val"] + ["alive"] * 2 + ["val"] + ["alive"] * 3 + ["test"]
