"""The step probe's scaled-weight DoRA variant (scripts/probe_dora_step.py: W' = rs W written by a
row-norm kernel, m's gradient by a sums-only kernel) through a whole forward and backward on the
simulated CUDA path: its kernels run and it gives the current code's loss and gradients, so a
GPU session can time it without first debugging it."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from test_kernels_simulated import build_dir, simulated  # noqa: F401


def test_scaled_weight_variant_makes_the_current_step(simulated, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts" / "probes"))
    import probe_dora_step as P
    from meshtune.adapters import dora as D, kernels as K, step_norms
    from meshtune.bench.models import Shape, add_adapters, build_model, perturb_adapters

    small = Shape(arch="qwen3", layers=1, hidden=64, intermediate=96, heads=2, kv_heads=1, vocab=64)
    model = build_model(small, mx.float32, quantized=False, seed=0)
    add_adapters(model, impl="meshtune", kind="dora", num_layers=-1, rank=4, scale=2.0)
    perturb_adapters(model, seed=1)
    model.train()
    tok = mx.random.randint(0, 64, (1, 9), key=mx.random.key(3))

    def loss(model):
        return nn.losses.cross_entropy(model(tok[:, :-1]).astype(mx.float32), tok[:, 1:]).mean()

    def run():
        with step_norms.step_row_norms(model, 8):
            l, g = nn.value_and_grad(model, loss)(model)
            mx.eval(l, g)
            return l, dict(tree_flatten(g))

    ref_l, ref = run()
    fn = P._scaled_weight_by_kernel
    monkeypatch.setattr(D.DoRALinear, "__call__", fn)
    monkeypatch.setattr(K, "row_norms_cuda", fn.row_norms)
    fn.prepare(model)
    l, got = run()
    assert P._SCALED, "the kernel variant did not run"
    assert abs(l.item() - ref_l.item()) < 1e-5
    for k, v in ref.items():
        assert mx.allclose(got[k], v, rtol=1e-3, atol=1e-5).item(), k
    assert simulated["meshtune_probe_row_norm_scaled_2"].calls >= 1 and simulated["meshtune_probe_column_sums"].calls == 7
