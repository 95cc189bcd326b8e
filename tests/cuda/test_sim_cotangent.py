"""The unfolded product's backward (meshtune/adapters/cuda/dora_cotangent.cuh's g * rs and column sums, then
dora_magnitude_grad.cuh's chunks added) run by the CPU simulator (cuda_sim.py), alone and in a DoRA layer."""

import mlx.core as mx
import pytest


@pytest.mark.parametrize("rows, cols", [(100, 40), (7, 16), (300, 18)])  # 16-byte accesses; 18: one column a thread
def test_cotangent_kernel(simulated, rows, cols):
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(rows), 3)
    g = mx.random.normal((rows, cols), key=k[0])
    y = mx.random.normal((rows, cols), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[2]).at[3].multiply(0.0)
    norm = mx.full((cols,), 2.0)
    rs = m / norm
    gz, dm = kernels.cotangent_cuda(g, y, m, norm)
    want_dm = mx.where(rs == 0, 0.0, (g * y).sum(0) / mx.where(rs == 0, 1.0, rs * norm))
    assert mx.allclose(gz, g * rs, rtol=1e-6).item()
    assert mx.allclose(dm, want_dm, rtol=1e-5, atol=1e-6).item() and dm[3].item() == 0.0
    assert simulated["meshtune_dora_cotangent"].calls == simulated["meshtune_dora_magnitude_grad"].calls == 1


def test_dora_layer_gradients_on_the_cuda_path(simulated):
    """dora_linear with both DoRA kernels simulated: value and every gradient as autodiff of the dense reference."""
    from meshtune.adapters.adapted_linear import dora_linear

    k = mx.random.split(mx.random.key(7), 6)
    x = mx.random.normal((2, 6, 24), key=k[0])
    w = mx.random.normal((20, 24), key=k[1]) / 4
    a = mx.random.normal((24, 4), key=k[2]) / 4
    b = mx.random.normal((4, 20), key=k[3]) / 4
    m = mx.random.uniform(0.5, 2.0, (20,), key=k[4])
    probe = mx.random.normal((2, 6, 20), key=k[5])

    def ours(x, a, b, m):
        return (dora_linear(x, w, a, b, 2.0, magnitude=m, w_sq=(w * w).sum(-1)) * probe).sum()

    def reference(x, a, b, m):
        dense = w + 2.0 * (a @ b).T
        z = x @ w.T + 2.0 * ((x @ a) @ b)
        return (m / mx.stop_gradient(mx.sqrt((dense * dense).sum(-1))) * z * probe).sum()

    got_v, got = mx.value_and_grad(ours, argnums=(0, 1, 2, 3))(x, a, b, m)
    want_v, want = mx.value_and_grad(reference, argnums=(0, 1, 2, 3))(x, a, b, m)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), name
    assert simulated["meshtune_dora_row_norm_1"].calls == 1 and simulated["meshtune_dora_cotangent"].calls == 1
