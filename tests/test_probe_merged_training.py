"""The merged fold's bfloat16 W' = rs (W + s (A B)^T) trains as the unmerged fold and the CPU's MLX ops do
(scripts/probes/merged_training.py, each form emulated in MLX ops on the CPU from the same weights and batches)."""

from pathlib import Path

import pytest


def test_merged_fold_trains_as_the_unmerged_forms(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts" / "probes"))
    import merged_training as P

    args = P.argparse.Namespace(steps=30, lr=1e-3, vocab=256)
    results = {form: P.train(form, args) for form in ("MLX ops (CPU path)", "unmerged fold", "merged fold")}
    first = results["MLX ops (CPU path)"][0][0]
    for form, (losses, held) in results.items():
        assert losses[0] == pytest.approx(first, rel=1e-6), form  # the same start: W' = W at step 0, to rounding
        assert held < 0.8 * first, form  # it learned
    reference = results["MLX ops (CPU path)"][1]
    assert results["merged fold"][1] == pytest.approx(reference, rel=0.02)
    assert results["unmerged fold"][1] == pytest.approx(reference, rel=0.02)
