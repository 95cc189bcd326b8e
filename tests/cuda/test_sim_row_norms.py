"""DoRA's row-norm launches (meshtune/adapters/cuda/dora_row_norms.cuh) run by the CPU simulator (cuda_sim.py):
the norms against the MLX ops the CPU path uses, and the folded launch's W', rs, A and B' (staged and resident
layouts, dense and packed-quantized bases, merged or not) against references and against each other."""

from collections import Counter

import mlx.core as mx
import pytest

from cuda_sim import assert_same_bits as _assert_same_bits


@pytest.mark.parametrize("r, inp, out", [(8, 2100, 45), (5, 70, 9), (16, 600, 17), (64, 200, 8)])  # A in 3, 1, 2, 4 tiles
def test_row_norm_kernel(simulated, r, inp, out):
    from meshtune.adapters import adapted_linear as AL, kernels

    k = mx.random.split(mx.random.key(r), 4)
    w = mx.random.normal((out, inp), key=k[0]) / 8
    a = mx.random.normal((inp, r), key=k[1]) / 8
    b = mx.random.normal((r, out), key=k[2]) / 8
    w_sq = (w * w).sum(-1)
    (norm,) = kernels.row_norms_cuda([w], [a], [b], [2.0])
    want_norm, _ = AL.dora_row_scale(a.T @ w.T, a, b, w_sq, mx.ones((out,)), 2.0, mx.float32)
    assert mx.allclose(norm, want_norm, rtol=1e-5).item()
    assert simulated["meshtune_dora_row_norm_1"].calls == 1


@pytest.mark.parametrize("most", [32, 2])  # one launch for the three layers; then two
def test_row_norms_of_several_layers_share_a_launch(simulated, most):
    """Layers of one shape, each with its own W, A, B and scale: each gets its own norms."""
    from meshtune.adapters import adapted_linear as AL, kernels

    r, inp, out = 4, 300, 21
    k = mx.random.split(mx.random.key(11), 9)
    ws = [mx.random.normal((out, inp), key=k[i]) / 8 for i in range(3)]
    as_ = [mx.random.normal((inp, r), key=k[3 + i]) / 8 for i in range(3)]
    bs = [mx.random.normal((r, out), key=k[6 + i]) / 8 for i in range(3)]
    scales = [2.0, 0.5, 7.0]
    got = kernels.row_norms_cuda(ws, as_, bs, scales, launch=kernels.RowNormLaunch(max_layers=most))
    assert len(got) == 3
    for w, a, b, s, norm in zip(ws, as_, bs, scales, got):
        want, _ = AL.dora_row_scale(a.T @ w.T, a, b, (w * w).sum(-1), mx.ones((out,)), s, mx.float32)
        assert mx.allclose(norm, want, rtol=1e-5).item()
    launches = {n: kern.calls for n, kern in simulated.items() if n.startswith("meshtune_dora_row_norm")}
    assert launches == ({"meshtune_dora_row_norm_3": 1} if most == 32 else
                        {"meshtune_dora_row_norm_2": 1, "meshtune_dora_row_norm_1": 1})


def test_row_norms_take_layers_of_one_shape_only(simulated):
    from meshtune.adapters import kernels

    w, a, b = mx.zeros((8, 16)), mx.zeros((16, 2)), mx.zeros((2, 8))
    with pytest.raises(ValueError, match="one shape"):
        kernels.row_norms_cuda([w, mx.zeros((9, 16))], [a, a], [b, mx.zeros((2, 9))], [1.0, 1.0])


def _one_layer(seed: int, r: int, inp: int, dtype=mx.bfloat16, out: int = 37) -> tuple[list, list, list, list]:
    """One layer's W (out, inp) in `dtype`, A, B and m for the row-norm kernels."""
    k = mx.random.split(mx.random.key(seed), 4)
    ws = [(mx.random.normal((out, inp), key=k[0]) / 8).astype(dtype)]
    as_, bs = [mx.random.normal((inp, r), key=k[1]) / 8], [mx.random.normal((r, out), key=k[2]) / 8]
    return ws, as_, bs, [mx.random.uniform(0.5, 2.0, (out,), key=k[3])]


def _both_kernels(ws, as_, bs, ms, launch=None) -> tuple:
    """row_norms_and_scaled_cuda's (norms, W', rs, A, B') and row_norms_cuda's norms, scale 2, laid out as
    `launch` (a kernels.RowNormLaunch; default the constants) says."""
    from meshtune.adapters import kernels

    launch = launch or kernels.LAUNCH
    return (kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0], ms, launch=launch)
            + (kernels.row_norms_cuda(ws, as_, bs, [2.0], launch=launch),))


def test_folded_launch_stages_a_by_smaller_tiles(simulated):
    """kernels.FOLDED_TILE_ROWS: the staged folded launch (norms and W') holds 256 rows of A a tile at rank 8
    (the norms-only kernel 1024), and gives what 1024-row tiles give, to the bit; a tile under a warp's
    16-byte loads of W is not taken."""
    from meshtune.adapters import kernels

    assert kernels.FOLDED_TILE_ROWS == 256
    assert kernels._row_scale_layout(8, 6144, 2, folded=True)[1:] == (8, 256)  # the 1B model's down projection
    assert kernels._row_scale_layout(8, 6144, 2)[1:] == (8, 1024)
    assert kernels._row_scale_layout(64, 6144, 2, folded=True)[2] == kernels._row_scale_layout(64, 6144, 2)[2]
    # 128 < 32 lanes x 8 columns
    assert kernels._row_scale_layout(8, 6144, 2, folded=True, tile_rows=128)[1:] == (8, 1024)
    case = _one_layer(9, 8, 2100)
    want = _both_kernels(*case, launch=kernels.RowNormLaunch(folded_tile_rows=1024))
    _assert_same_bits(_both_kernels(*case), want, 256)


@pytest.mark.parametrize("inp, out, r, dtype, rows, batch", [
    (256, 45, 8, mx.bfloat16, 16, 3),  # 32 threads of 8 columns; 45 rows: blocks of 16, batches of 3, the last short
    (512, 70, 8, mx.bfloat16, 64, 2),  # 64 threads (two warps added through shared memory); one block, part-filled
    (384, 19, 5, mx.float32, 8, 2),  # 4 columns a thread (float32), rank 5, three warps
])
def test_resident_folded_kernel_matches_the_staged_one(simulated, inp, out, r, dtype, rows, batch):
    """The folded launch with A held in registers (a thread's columns of every row) gives the
    staged kernel's norms and rs (float32 sums in another order: within 1e-6), W' = rs W from those rs, and A and
    B' = B rs, two layers a launch, rows not a multiple of a block or a batch."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(inp + out), 8)
    ws = [(mx.random.normal((out, inp), key=k[i]) / 8).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) / 8 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) / 8 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2.0, (out,), key=k[i]) for i in (6, 7)]
    resident = kernels.RowNormLaunch(resident_rows=rows, resident_batch=batch)
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms, launch=resident)
    assert simulated[kernels.row_norm_kernel_name(2, True, resident=True)].calls == 1
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms, launch=kernels.RowNormLaunch(resident=False))
    assert simulated[kernels.row_norm_kernel_name(2, True)].calls == 1
    norms, scaled, row_scales, a_cast, b_scaled = got
    for n, want_n, rs, want_rs, m, w, sw, ac, a_l, bs, b_l in zip(norms, want[0], row_scales, want[2], ms, ws,
                                                                 scaled, a_cast, a, b_scaled, b):
        assert mx.allclose(n, want_n, rtol=1e-6).item() and mx.allclose(rs, want_rs, rtol=1e-6).item()
        assert mx.allclose(rs, m / n, rtol=1e-6).item()
        assert mx.array_equal(sw, (rs[:, None] * w.astype(mx.float32)).astype(dtype)).item()
        assert mx.array_equal(ac, a_l.astype(dtype)).item() and mx.array_equal(bs, (b_l * rs).astype(dtype)).item()


def test_resident_folded_kernel_reads_quantized_weights_packed(simulated):
    """The resident-A launch on a 4-bit base read packed gives what it gives on the dequantized weight."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(5), 8)
    layers = [nn.QuantizedLinear.from_linear(nn.Linear(512, 37, bias=False), group_size=64, bits=4) for _ in range(2)]
    packed = [kernels.packed_weight(layer) for layer in layers]
    dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=4) for w in packed]
    a = [mx.random.normal((512, 8), key=k[i]) / 8 for i in range(2)]
    b = [mx.random.normal((8, 37), key=k[2 + i]) for i in range(2)]
    ms = [mx.random.uniform(0.5, 2.0, (37,), key=k[4 + i]) for i in range(2)]
    launch = kernels.RowNormLaunch(resident_rows=16)
    want = kernels.row_norms_and_scaled_cuda(dense, a, b, [2.0, 0.5], ms, launch=launch)
    got = kernels.row_norms_and_scaled_cuda(packed, a, b, [2.0, 0.5], ms, launch=launch)
    assert simulated[kernels.row_norm_kernel_name(2, True, packed=True, resident=True)].calls == 1
    assert simulated[kernels.row_norm_kernel_name(2, True, resident=True)].calls == 1
    for kind, gots, wants in zip(("norm", "W'", "rs", "A", "B'"), got, want):
        for g, w in zip(gots, wants):
            assert g.shape == w.shape and mx.allclose(g, w, rtol=1e-6, atol=1e-6).item(), kind


@pytest.mark.parametrize("inp, out", [(64, 40), (24, 19)])  # 16-byte accesses; 24 x 19: ragged rows, one a lane
def test_row_norm_kernel_writing_scaled_weights(simulated, inp, out):
    """row_norms_and_scaled_cuda: row_norms_cuda's norms, W' = rs W and rs, two layers in one launch."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(inp + out), 8)
    ws = [mx.random.normal((out, inp), key=k[i]) * 0.2 for i in (0, 1)]
    a = [mx.random.normal((inp, 4), key=k[i]) * 0.1 for i in (2, 3)]
    b = [mx.random.normal((4, out), key=k[i]) * 0.1 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[i]) for i in (6, 7)]
    norms, scaled, row_scales, _, _ = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms)
    want = kernels.row_norms_cuda(ws, a, b, [2.0, 0.5])
    for n, want_n, w, m, sw, rs in zip(norms, want, ws, ms, scaled, row_scales):
        assert mx.allclose(n, want_n, rtol=1e-5).item()
        assert mx.allclose(rs, m / n, rtol=1e-6).item()
        assert mx.allclose(sw, (m / n)[:, None] * w, rtol=1e-5, atol=1e-7).item()
    assert simulated["meshtune_dora_row_norm_folded_2"].calls == 1


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("inp, out, r, dtype, quantized", [
    (256, 45, 8, mx.bfloat16, False),  # bf16: 8 columns a lane or a thread
    (384, 19, 5, mx.float32, False),  # rank 5, 4 columns a lane
    (512, 37, 8, mx.bfloat16, True),  # a 4-bit base read packed
])
def test_merged_folded_launch_writes_the_whole_adapted_weight(simulated, resident, inp, out, r, dtype, quantized):
    """With `merged` (a folded step's layers without dropout) the folded launch (A resident or staged, dense or packed base) writes
    W' = rs (W + s (A B)^T), each element the one its norm was taken of; norms, rs, A and B' are the unmerged
    launch's, bit for bit."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    launch = kernels.RowNormLaunch(resident_rows=16, resident=resident)
    k = mx.random.split(mx.random.key(inp + out + r), 8)
    if quantized:
        layers = [nn.QuantizedLinear.from_linear(nn.Linear(inp, out, bias=False), group_size=64, bits=4)
                  for _ in range(2)]
        ws = [kernels.packed_weight(layer) for layer in layers]
        dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=4) for w in ws]
    else:
        ws = dense = [(mx.random.normal((out, inp), key=k[i]) / 8).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) / 8 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) / 2 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2.0, (out,), key=k[i]) for i in (6, 7)]
    scales = [2.0, 0.5]
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms, factors=True, merged=True, launch=launch)
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms, launch=launch)
    vec = 16 // dense[0].dtype.size if not quantized else kernels._packed_layout(r, ws[0])[1]
    on_resident = resident and kernels._resident_layout(r, inp, vec)
    assert on_resident == resident  # each case takes the layout it names
    assert simulated[kernels.row_norm_kernel_name(2, True, packed=quantized, resident=resident,
                                                  merged=True)].calls == 1
    for kind, gots, wants in zip(("norm", "rs", "A", "B'"), (got[0], *got[2:]), (want[0], *want[2:])):
        for g, w in zip(gots, wants):
            assert mx.array_equal(g, w).item(), kind
    for w, a_l, b_l, s, rs, sw in zip(dense, a, b, scales, got[2], got[1]):
        adapted = w.astype(mx.float32) + s * (a_l @ b_l).T
        assert sw.dtype == w.dtype
        reference = (rs[:, None] * adapted).astype(w.dtype).astype(mx.float32)
        # float32 sums of r products in another order: within an ulp of W's dtype
        assert mx.allclose(sw.astype(mx.float32), reference, rtol=2 ** -7 if w.dtype == mx.bfloat16 else 1e-6,
                           atol=1e-6).item()
        assert not mx.allclose(sw.astype(mx.float32), (rs[:, None] * w.astype(mx.float32)), atol=1e-3).item()


def test_only_the_folded_launch_merges(simulated):
    """A merged W' is the folded launch's: the norms-only launch refuses it."""
    from meshtune.adapters import kernels

    w, a, b = mx.ones((8, 32)), mx.ones((32, 4)), mx.ones((4, 8))
    with pytest.raises(ValueError, match="folded launch"):
        kernels._row_norms([w], [a], [b], [1.0], None, merged=True)


def test_a_launch_of_twelve_layers_gives_each_layer_its_own_outputs(simulated):
    """A folded launch of more than kernels.SPLIT_PARTS layers (its outputs' views from nested splits): each
    layer's norms, W', rs, A and B' are the ones a launch of that layer alone writes, bit for bit."""
    from meshtune.adapters import kernels

    n, inp, out, r = 12, 24, 19, 3
    k = mx.random.split(mx.random.key(12), 4 * n)
    ws = [mx.random.normal((out, inp), key=k[i]) * 0.2 for i in range(n)]
    a = [mx.random.normal((inp, r), key=k[n + i]) * 0.1 for i in range(n)]
    b = [mx.random.normal((r, out), key=k[2 * n + i]) * 0.1 for i in range(n)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[3 * n + i]) for i in range(n)]
    scales = [0.5 + i for i in range(n)]
    together = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms)
    assert [len(part) for part in together] == [n] * 5
    for i in range(n):
        alone = kernels.row_norms_and_scaled_cuda(ws[i:i + 1], a[i:i + 1], b[i:i + 1], scales[i:i + 1], ms[i:i + 1])
        for got, want in zip((part[i] for part in together), (part[0] for part in alone)):
            assert got.shape == want.shape and mx.array_equal(got, want).item(), i
    assert simulated[f"meshtune_dora_row_norm_folded_{n}"].calls == 1


@pytest.mark.parametrize("n", [1, 2, 10, 11, 28, 32, 100])  # a launch takes 32 layers at most
def test_layer_views_are_split_parts_in_few_graph_nodes(n):
    """kernels.layer_views: mx.split's n parts (same values and shapes, no copies), and as Split nodes of at
    most SPLIT_PARTS parts, not MLX's Slice a part beyond 10 (a node a layer for the host on every step)."""
    import io
    import re

    from meshtune.adapters import kernels

    x = mx.arange(n * 6).reshape(n * 3, 2) + 0
    views = kernels.layer_views(x, n)
    dot = io.StringIO()
    mx.export_to_dot(dot, *views)
    nodes = Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))
    assert nodes["Slice"] == 0
    assert nodes["Split"] <= (0 if n == 1 else 1 + -(-n // kernels.SPLIT_PARTS))
    want = mx.split(x, n) if n > 1 else [x]
    assert len(views) == n
    for got, ref in zip(views, want):
        assert got.shape == ref.shape and mx.array_equal(got, ref).item()


@pytest.mark.parametrize("inp, out, r, dtype", [(64, 40, 4, mx.bfloat16), (24, 19, 3, mx.float32),
                                                (40, 70, 40, mx.bfloat16)])  # rank 40: B' a lane past 32
def test_row_norm_kernel_writing_factors(simulated, inp, out, r, dtype):
    """row_norms_and_scaled_cuda: the norms-only launch's norms, W' = rs W and rs = m / norm, and each layer's A and
    B' = B rs in W's dtype as the layers would cast them, to the bit, two layers a launch."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(inp + r), 8)
    ws = [(mx.random.normal((out, inp), key=k[i]) * 0.2).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) * 0.1 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) * 0.1 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[i]) for i in (6, 7)]
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms)
    norms = kernels.row_norms_cuda(ws, a, b, [2.0, 0.5])
    for n, sw, rs, a_cast, b_scaled, want_n, w, m, a_l, b_l in zip(*got, norms, ws, ms, a, b):
        assert mx.array_equal(n, want_n).item()
        # The simulator's WT is float: rs is not rounded to W's dtype here (on a GPU it is, test_adapted_linear.py).
        assert mx.array_equal(rs, m / n).item()
        assert sw.dtype == dtype and mx.array_equal(sw, (rs[:, None] * w.astype(mx.float32)).astype(dtype)).item()
        assert a_cast.dtype == dtype and b_scaled.dtype == dtype
        assert mx.array_equal(a_cast, a_l.astype(dtype)).item()
        assert mx.array_equal(b_scaled, (b_l * rs).astype(dtype)).item()
    assert simulated["meshtune_dora_row_norm_folded_2"].calls == 1


@pytest.mark.parametrize("bits, group_size, inp", [(4, 64, 2112), (8, 32, 320), (2, 64, 1088)])
def test_folded_launch_reads_quantized_weights_packed(simulated, bits, group_size, inp):
    """row_norms_and_scaled_cuda on PackedWeight (affine, 2/4/8 bits; A in more than one tile for 4 bits): the
    norms, W', rs, A and B' it gives from the dequantized weight, two layers in one launch."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(21), 8)
    layers = [nn.QuantizedLinear.from_linear(nn.Linear(inp, 45, bias=False), group_size=group_size, bits=bits)
              for _ in range(2)]
    packed = [kernels.packed_weight(layer) for layer in layers]
    assert all(w is not None and kernels.reads_packed(w, 8) for w in packed)
    dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=group_size, bits=bits) for w in packed]
    a = [mx.random.normal((inp, 8), key=k[i]) / 8 for i in range(2)]
    b = [mx.random.normal((8, 45), key=k[2 + i]) for i in range(2)]
    ms = [mx.random.uniform(0.5, 2.0, (45,), key=k[4 + i]) for i in range(2)]
    want = kernels.row_norms_and_scaled_cuda(dense, a, b, [2.0, 0.5], ms)
    got = kernels.row_norms_and_scaled_cuda(packed, a, b, [2.0, 0.5], ms)
    for kind, gots, wants in zip(("norm", "W'", "rs", "A", "B'"), got, want):
        for g, w in zip(gots, wants):
            assert g.shape == w.shape and mx.allclose(g, w, rtol=1e-6, atol=1e-6).item(), kind
    assert simulated["meshtune_dora_row_norm_packed_folded_2"].calls == 1


def test_packed_weights_only_where_the_launch_reads_them(simulated):
    """kernels.packed_weight: affine QuantizedLinear of 2, 4 or 8 bits only (3 bits straddle words, the fp modes
    have no biases); the launch refuses a packed weight it cannot lay out a word a lane, or unfolded."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    base = nn.Linear(256, 16, bias=False)
    assert kernels.packed_weight(base) is None
    assert kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=64, bits=3)) is None
    assert kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=32, bits=4, mode="mxfp4")) is None
    packed = kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=64, bits=4))
    assert packed.shape == (16, 256) and not kernels.reads_packed(packed, 64)  # a tile of A under a warp's columns
    a, b = [mx.zeros((256, 4))], [mx.zeros((4, 16))]
    with pytest.raises(ValueError, match="folded launch only"):
        kernels.row_norms_cuda([packed], a, b, [1.0])


def test_row_norm_kernel_per_weight_dtype(simulated):
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(1), 3)
    w = mx.random.normal((9, 40), key=k[0]) / 8
    a, b = mx.random.normal((40, 4), key=k[1]) / 8, mx.random.normal((4, 9), key=k[2]) / 8
    for weight in (w, w.astype(mx.bfloat16)):
        kernels.row_norms_cuda([weight], [a], [b], [2.0])
    assert simulated["meshtune_dora_row_norm_1"].calls == 2
