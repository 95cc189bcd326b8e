"""The folded backward's launches for m's and B's gradients (meshtune/adapters/cuda/dora_cotangent.cuh's column and
B sums, dora_magnitude_grad.cuh's chunks added) run by the CPU simulator (cuda_sim.py), against MLX ops."""

import mlx.core as mx
import pytest

from cuda_sim import FOLDED_GRAD, FOLDED_SUMS


def _reference(g, y, u, m, norm, b_scale):
    """(m's gradient, B's) in float32 MLX ops as the simulator forms them (its element types are float: rs unrounded)."""
    g, y, u = (x.astype(mx.float32) for x in (g, y, u))
    rs = m / norm
    dm = mx.where(rs == 0, 0.0, (g * y).sum(0) / mx.where(rs == 0, 1.0, rs * norm))
    return dm, b_scale * (u.T @ g) * rs


@pytest.mark.parametrize("rows, cols, r, dtype", [(100, 40, 4, mx.bfloat16), (1000, 70, 12, mx.float32),
                                                  (37, 24, 8, mx.bfloat16), (300, 18, 3, mx.float16)])
def test_b_product_summed_with_the_magnitude_sums(simulated, rows, cols, r, dtype):
    """magnitude_and_b_grad_cuda: the column sums' pass also sums (x A)^T g by chunks, the second kernel adds the
    chunks in order: m's gradient as sum_t g y / (rs norm) (0 where m is) and B's as (s p) rs from the matmul's
    product p, to float32 rounding of the sums. 1000 rows: several chunks; 70 and 18 columns: blocks part-filled,
    one column a thread; rank 12: more rows of B than warps."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(21), 5)
    g, y = mx.random.normal((rows, cols), key=k[0]).astype(dtype), mx.random.normal((rows, cols), key=k[1]).astype(dtype)
    u = mx.random.normal((rows, r), key=k[2]).astype(dtype)
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[3]).at[5].multiply(0.0)
    norm = mx.random.uniform(0.5, 3.0, (cols,), key=k[4])
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, 1.5, rs_dtype=dtype)
    want_dm, want_gb = _reference(g, y, u, m, norm, 1.5)
    assert dm.shape == (cols,) and gb.shape == (r, cols) and dm.dtype == gb.dtype == mx.float32
    assert mx.allclose(dm, want_dm, rtol=1e-5, atol=1e-5).item() and dm[5].item() == 0.0
    assert mx.allclose(gb, want_gb, rtol=1e-4, atol=1e-4).item()
    assert simulated[FOLDED_SUMS].calls == 1 and simulated[FOLDED_GRAD].calls == 1


def test_magnitude_and_b_gradient_from_a_launchs_stacked_norms(simulated):
    """magnitude_and_b_grad_cuda with a StackedNorm (the layer's norms inside a launch's array, read at its offset):
    m's and B's gradients as from a view of those norms, to the bit, and d B = (s p) rs with rs = m / norm."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(12), 5)
    g, y = mx.random.normal((100, 40), key=k[0]), mx.random.normal((100, 40), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (40,), key=k[2]).at[3].multiply(0.0)
    launch = mx.random.uniform(0.5, 3.0, (120,), key=k[3])  # three layers' norms; this layer's are the second
    stacked = kernels.StackedNorm(launch, 40, 40)
    u = mx.random.normal((100, 4), key=k[4])
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, stacked, 2.5)
    norm = launch[40:80]
    assert mx.array_equal(stacked.view(), norm).item()
    want_dm, want_gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, 2.5)
    assert mx.array_equal(dm, want_dm).item() and mx.array_equal(gb, want_gb).item()
    assert mx.allclose(gb, _reference(g, y, u, m, norm, 2.5)[1], rtol=1e-4, atol=1e-5).item()
    assert simulated[FOLDED_GRAD].calls == 2


def test_magnitude_and_b_gradient_over_many_chunks_and_rows_of_b(simulated):
    """The sums' second kernel (a block's 8 warps each add every 8th chunk, then each column the 8 sums in
    order) over 31 chunks, 70 columns (a block of 32 part-filled) and B with 12 rows (more rows than warps):
    m's gradient as sum_t g y / (rs norm), and as the cotangent kernel's (the same chunks: the same bits),
    d B = (s p) rs, with a zero m giving 0."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(13), 5)
    rows, cols = 1000, 70
    g, y = mx.random.normal((rows, cols), key=k[0]), mx.random.normal((rows, cols), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[2]).at[5].multiply(0.0)
    norm = mx.random.uniform(0.5, 3.0, (cols,), key=k[3])
    u = mx.random.normal((rows, 12), key=k[4])
    assert kernels.b_sums_grid(rows, cols, 12, g.dtype)[2:] == kernels.cotangent_grid(rows, cols, g.dtype)[2:] == (33, 31)
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, 1.5)
    want_dm, want_gb = _reference(g, y, u, m, norm, 1.5)
    assert mx.allclose(dm, want_dm, rtol=1e-5, atol=1e-5).item() and dm[5].item() == 0.0
    assert mx.allclose(gb, want_gb, rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(dm, kernels.cotangent_cuda(g, y, m, norm)[1]).item()


def test_no_kernel_reads_an_array_of_8_bytes_or_less(simulated):
    """MLX's CUDA allocator keeps arrays of 8 bytes or less in a managed pool the GPU reads across the bus
    (cuda.kernel_constant): the folded launch's scales with one layer, m's gradient's offset into a launch's
    norms and B's scale are all handed to the kernels padded past it, the kernels' results unchanged."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(14), 7)
    w, a, b = mx.random.normal((24, 64), key=k[0]), mx.random.normal((64, 4), key=k[1]), mx.random.normal((4, 24), key=k[2])
    m = mx.random.uniform(1.0, 2.0, (24,), key=k[3])
    norms = kernels.row_norms_and_scaled_cuda([w], [a], [b], [2.0], [m], stacked=True)[0]
    g, y = mx.random.normal((40, 24), key=k[4]), mx.random.normal((40, 24), key=k[5])
    u = mx.random.normal((40, 4), key=k[6])
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norms[0], 2.0)
    assert mx.allclose(gb, _reference(g, y, u, m, norms[0].view(), 2.0)[1], rtol=1e-4, atol=1e-5).item()
    smallest = {name: kernel.smallest_input for name, kernel in simulated.items() if kernel.calls}
    assert set(smallest) >= {"meshtune_dora_row_norm_folded_1", FOLDED_SUMS, FOLDED_GRAD}, smallest
    assert min(smallest.values()) > 8, smallest
