"""The adapted linear products' hand-written backwards equal autodiff of the plain expression."""

import mlx.core as mx
import pytest

from meshtune.adapters.adapted_linear import dora_linear, folded_dora_linear, lora_linear, merged_dora_linear

T, IN, OUT, R, S = 12, 16, 24, 4, 2.0


def _inputs(seed=0, tokens=T):
    k = mx.random.split(mx.random.key(seed), 6)
    x = mx.random.normal((3, tokens // 3, IN), key=k[0])
    w = mx.random.normal((OUT, IN), key=k[1]) / 4
    a = mx.random.normal((IN, R), key=k[2]) / 4
    b = mx.random.normal((R, OUT), key=k[3]) / 4
    m = mx.random.uniform(0.5, 2.0, (OUT,), key=k[4])
    mask = (mx.random.uniform(shape=x.shape, key=k[5]) > 0.3).astype(x.dtype) / 0.7
    return x, w, a, b, m, mask


def _reference(x, w, a, b, m, xl):
    """The plain expression, DoRA's norm taken densely on W + s (A B)^T and held constant."""
    z = x @ w.T + S * ((xl @ a) @ b)
    if m is None:
        return z
    dense = w + S * (a @ b).T
    return m / mx.stop_gradient(mx.sqrt((dense * dense).sum(-1))) * z


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("tokens", [T, 2 * T])  # fewer, then more tokens than input features
def test_gradients_match_autodiff(dora, dropout, tokens):
    x, w, a, b, m, mask = _inputs(tokens=tokens)
    probe = mx.random.normal((3, tokens // 3, OUT), key=mx.random.key(9))

    def loss(fn, x, a, b, m):
        xl = x * mask if dropout else x
        return (fn(x, a, b, m if dora else None, xl) * probe).sum()

    def ours(x, a, b, m, xl):
        if m is None:
            return lora_linear(x, w, a, b, S, x_lora=xl)
        return dora_linear(x, w, a, b, S, x_lora=xl, magnitude=m, w_sq=(w * w).sum(-1))

    def ref(x, a, b, m, xl):
        return _reference(x, w, a, b, m, xl)

    args = (x, a, b, m)
    got_v, got = mx.value_and_grad(lambda *p: loss(ours, *p), argnums=(0, 1, 2, 3))(*args)
    want_v, want = mx.value_and_grad(lambda *p: loss(ref, *p), argnums=(0, 1, 2, 3))(*args)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        if name == "m" and not dora:
            continue
        assert g.shape == h.shape, name
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), (name, mx.abs(g - h).max().item())


@pytest.mark.parametrize("dropout", [False, True])
def test_a_given_norm_is_the_constant_norm(dropout):
    """A step's batched norm (step_norms.py) in place of the layer's own: the same value and
    gradients as autodiff of the plain expression, and the norm given is the one used."""
    x, w, a, b, m, mask = _inputs(2)
    probe = mx.random.normal((3, T // 3, OUT), key=mx.random.key(8))
    dense = w + S * (a @ b).T
    norm = mx.sqrt((dense * dense).sum(-1))

    def loss(fn, x, a, b, m):
        return (fn(x, a, b, m, x * mask if dropout else x) * probe).sum()

    def ours(x, a, b, m, xl, norm=norm):
        return dora_linear(x, w, a, b, S, x_lora=xl, magnitude=m, w_sq=(w * w).sum(-1), norm=norm)

    got_v, got = mx.value_and_grad(lambda *p: loss(ours, *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    want_v, want = mx.value_and_grad(lambda *p: loss(lambda x, a, b, m, xl: _reference(x, w, a, b, m, xl), *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), (name, mx.abs(g - h).max().item())
    doubled = dora_linear(x, w, a, b, S, magnitude=m, w_sq=(w * w).sum(-1), norm=2 * norm)
    assert mx.allclose(2 * doubled, ours(x, a, b, m, x), rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("tokens", [T, 2 * T])
def test_zero_magnitude_gets_zero_gradient_not_nan(tokens):
    x, w, a, b, m, _ = _inputs(1, tokens)
    m = m.at[0].multiply(0.0)
    g = mx.grad(lambda m: dora_linear(x, w, a, b, S, magnitude=m, w_sq=(w * w).sum(-1)).sum())(m)
    assert g[0].item() == 0.0 and mx.isfinite(g).all().item()


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_folded_product_is_doras(dropout, dtype):
    """DoRA's row scale folded into W' = rs W and B' = B rs (folded_dora_linear): the product
    and every gradient (m's from the output kept) are those of the plain expression."""
    x, w, a, b, m, mask = _inputs(3)
    x, w, mask = x.astype(dtype), w.astype(dtype), mask.astype(dtype)
    probe = mx.random.normal((3, T // 3, OUT), key=mx.random.key(7)).astype(dtype)
    w32 = w.astype(mx.float32)
    dense = w32 + S * (a @ b).T
    norm = mx.sqrt((dense * dense).sum(-1))

    def loss(fn, x, a, b, m):
        return (fn(x, a, b, m, x * mask if dropout else x).astype(mx.float32) * probe).sum()

    def folded(x, a, b, m, xl):
        rs = (m / norm).astype(dtype)
        return folded_dora_linear(x, rs[:, None] * w, a, b, S, x_lora=xl, magnitude=m, norm=norm,
                                  row_scale=rs.astype(mx.float32))

    def ref(x, a, b, m, xl):
        return _reference(x.astype(mx.float32), w32, a, b, m, xl.astype(mx.float32))

    got_v, got = mx.value_and_grad(lambda *p: loss(folded, *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    want_v, want = mx.value_and_grad(lambda *p: loss(ref, *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    assert abs(got_v.item() - want_v.item()) <= tol * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        g, h = g.astype(mx.float32), h.astype(mx.float32)
        assert mx.allclose(g, h, rtol=tol, atol=tol * mx.abs(h).max().item()).item(), (name, mx.abs(g - h).max().item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_merged_product_is_doras(dtype):
    """The merged fold (a folded step's layers without dropout): W' = rs (W + s (A B)^T) is the whole adapted weight, y = x W'^T one
    product, and every gradient (x's as g W', m's from the output kept) is the plain expression's."""
    x, w, a, b, m, _ = _inputs(4)
    x, w = x.astype(dtype), w.astype(dtype)
    probe = mx.random.normal((3, T // 3, OUT), key=mx.random.key(8)).astype(dtype)
    w32 = w.astype(mx.float32)

    def loss(fn, x, a, b, m):
        return (fn(x, a, b, m).astype(mx.float32) * probe).sum()

    def merged(x, a, b, m):
        dense = w32 + S * (mx.stop_gradient(a) @ mx.stop_gradient(b)).T
        norm = mx.sqrt((dense * dense).sum(-1))
        rs = (mx.stop_gradient(m) / norm).astype(dtype).astype(mx.float32)
        return merged_dora_linear(x, (rs[:, None] * dense).astype(dtype), a, b, S, magnitude=m, norm=norm,
                                  row_scale=rs)

    def ref(x, a, b, m):
        return _reference(x.astype(mx.float32), w32, a, b, m, x.astype(mx.float32))

    got_v, got = mx.value_and_grad(lambda *p: loss(merged, *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    want_v, want = mx.value_and_grad(lambda *p: loss(ref, *p), argnums=(0, 1, 2, 3))(x, a, b, m)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    # The loss is a sum whose terms cancel (-0.30 from terms of ~195 in magnitude here): bf16 is judged against them.
    terms = mx.abs(ref(x, a, b, m) * probe.astype(mx.float32)).sum().item()
    assert abs(got_v.item() - want_v.item()) <= max(tol * abs(want_v.item()), (0 if dtype == mx.float32 else 1e-3) * terms)
    for name, g, h in zip("x a b m".split(), got, want):
        g, h = g.astype(mx.float32), h.astype(mx.float32)
        assert mx.allclose(g, h, rtol=tol, atol=tol * mx.abs(h).max().item()).item(), (name, mx.abs(g - h).max().item())


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="CUDA kernels")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("r", [8, 16, 64])  # the row scale: 2 rows a warp, 2, then 1 with 4-byte loads of W
def test_dora_kernels_match_mlx_ops_on_cuda(dtype, r):
    from meshtune.adapters import adapted_linear as AL, kernels

    k = mx.random.split(mx.random.key(4), 6)
    rows, inp = 4100, 1324  # A in 1, 2 and 20 tiles and a part
    out = 6150 if r == 16 else 6144  # the cotangent a column a thread, else 16-byte accesses
    g = mx.random.normal((rows, out), key=k[0]).astype(dtype)
    y = mx.random.normal((rows, out), key=k[1]).astype(dtype)
    w = (mx.random.normal((out, inp), key=k[2]) / 8).astype(dtype)
    a = mx.random.normal((inp, r), key=k[3]) / 8
    b = mx.random.normal((r, out), key=k[4]) / 8
    w32 = w.astype(mx.float32)
    w_sq = (w32 * w32).sum(-1)
    m = mx.sqrt(w_sq).at[3].multiply(0.0)  # a zero row scale gets d m = 0
    rs = (m / w_sq).astype(dtype)
    # Three layers in one launch, the second with the first's factors at another scale.
    norms = kernels.row_norms_cuda([w, w, w * 0.5], [a, a, a], [b, b, b], [S, 2 * S, S])
    got = (norms[0], kernels.row_norms_cuda([w], [a], [b], [S])[0], norms[1], norms[2],
           *kernels.cotangent_cuda(g, y, m, w_sq))
    want_norm = AL.dora_row_scale(a.T @ w32.T, a, b, w_sq, m, S, dtype)[0]
    w2 = (w * 0.5).astype(mx.float32)
    want = (want_norm, want_norm, AL.dora_row_scale(a.T @ w32.T, a, b, w_sq, m, 2 * S, dtype)[0],
            AL.dora_row_scale(a.T @ w2.T, a, b, (w2 * w2).sum(-1), m, S, dtype)[0],
            *AL.dora_cotangent(g, y, rs, w_sq))
    names = ("norm", "norm alone", "norm, 2nd layer", "norm, 3rd layer", "g*rs", "dm")
    for name, x, v, tol in zip(names, got, want, (1e-4, 1e-4, 1e-4, 1e-4, 1e-2, 1e-4)):
        assert x.dtype == v.dtype and x.shape == v.shape, name
        assert mx.allclose(x.astype(mx.float32), v.astype(mx.float32), rtol=tol, atol=tol).item(), name
    assert mx.array_equal(got[0], got[1]).item()  # a layer's norm does not depend on its launch
    assert got[5][3].item() == 0.0
    # The folded step's launch: the same norms with W' = rs W, rs, and the layers' A and B' = B rs beside them.
    norms2, scaled, row_scales, a_casts, b_scaleds = kernels.row_norms_and_scaled_cuda([w, w * 0.5], [a, a], [b, b],
                                                                                      [S, S], [m, m * 2])
    assert mx.array_equal(norms2[0], got[0]).item() and mx.array_equal(norms2[1], got[3]).item()
    for n, mm, ww, sw, rs2 in zip(norms2, (m, m * 2), (w, w * 0.5), scaled, row_scales):
        assert rs2.dtype == mx.float32 and mx.allclose(rs2, (mm / n).astype(dtype).astype(mx.float32), rtol=1e-2 if dtype == mx.bfloat16 else 1e-6).item()
        want_sw = (mm / n).astype(dtype)[:, None] * ww  # to an ulp of W's dtype (a division's rounding may differ)
        tol = 1e-2 if dtype == mx.bfloat16 else 1e-6
        assert sw.dtype == dtype and mx.allclose(sw, want_sw, rtol=tol, atol=tol * 1e-3).item()
    # A and B' = B rs as the layers would cast them.
    for a_cast, b_scaled, rs2 in zip(a_casts, b_scaleds, row_scales):
        assert mx.array_equal(a_cast, a.astype(dtype)).item() and mx.array_equal(b_scaled, (b * rs2).astype(dtype)).item()


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="CUDA kernels")
def test_a_folded_launch_of_twelve_layers_gives_a_lone_launchs_bits_on_cuda():
    """A folded launch of more than kernels.SPLIT_PARTS layers, its outputs handed out by nested splits, then used
    by a matmul as the step uses W', A and B': each layer's outputs and products are a launch of its own's, bit for bit."""
    from meshtune.adapters import kernels

    n, out, inp, r = 12, 2048, 1024, 8
    k = mx.random.split(mx.random.key(12), 5)
    ws = list((mx.random.normal((n, out, inp), key=k[0]) / 8).astype(mx.bfloat16))
    a = list(mx.random.normal((n, inp, r), key=k[1]) / 8)
    b = list(mx.random.normal((n, r, out), key=k[2]) / 8)
    ms = list(mx.random.uniform(0.5, 2.0, (n, out), key=k[3]))
    x = mx.random.normal((256, inp), key=k[4]).astype(mx.bfloat16)
    together = kernels.row_norms_and_scaled_cuda(ws, a, b, [S] * n, ms)
    for i in range(n):
        alone = kernels.row_norms_and_scaled_cuda(ws[i:i + 1], a[i:i + 1], b[i:i + 1], [S], ms[i:i + 1])
        for name, got, want in zip(("norm", "W'", "rs", "A", "B'"), (part[i] for part in together),
                                   (part[0] for part in alone)):
            assert got.shape == want.shape and mx.array_equal(got, want).item(), (i, name)
        w_scaled, a_cast, b_scaled = together[1][i], together[3][i], together[4][i]
        assert mx.array_equal(x @ w_scaled.T + (x @ a_cast) @ b_scaled,
                              x @ alone[1][0].T + (x @ alone[3][0]) @ alone[4][0]).item(), i


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="CUDA kernels")
@pytest.mark.parametrize("cols, r", [(6144, 8), (1024, 8), (2048, 64)])
def test_b_product_in_the_sums_pass_matches_the_matmul_on_cuda(cols, r):
    """kernels.magnitude_and_b_grad_cuda at the 1B step's sizes (4096 tokens, bf16): m's gradient as the cotangent
    kernel's (its chunks of rows apart) and B's as (s p) rs from cuBLAS's product p = (x A)^T g, to bfloat16
    rounding (the product's sum runs in another order, float32 either way)."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(9), 5)
    g = mx.random.normal((4096, cols), key=k[0]).astype(mx.bfloat16)
    y = mx.random.normal((4096, cols), key=k[1]).astype(mx.bfloat16)
    u = mx.random.normal((4096, r), key=k[2]).astype(mx.bfloat16)
    m = mx.random.uniform(0.5, 2.0, (cols,), key=k[3])
    norm = mx.random.uniform(0.5, 2.0, (cols,), key=k[4])
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, 2 * S)
    want_dm = kernels.cotangent_cuda(g, y, m, norm)[1]
    rs = (m / norm).astype(mx.bfloat16).astype(mx.float32)
    want_gb = ((2 * S) * (u.T @ g)).astype(mx.float32) * rs
    assert mx.allclose(dm, want_dm, rtol=1e-4, atol=1e-3).item(), mx.abs(dm - want_dm).max().item()
    assert mx.allclose(gb, want_gb, rtol=2e-2, atol=1e-2 * mx.abs(want_gb).max().item()).item(), \
        mx.abs(gb - want_gb).max().item()


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="CUDA kernels")
@pytest.mark.parametrize("bits", [4, 8])
def test_folded_kernels_read_packed_weights_and_stacked_norms_on_cuda(bits):
    """The folded step's launch on a quantized base read packed gives what it gives on the dequantized weight, and
    m's and B's gradients from a launch's stacked norms are those from a view of them."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(5), 6)
    out, inp, r = 6144, 2048, 8
    layers = [nn.QuantizedLinear.from_linear(nn.Linear(inp, out, bias=False), group_size=64, bits=bits)
              for _ in range(2)]
    for layer in layers:
        layer.scales, layer.biases = layer.scales.astype(mx.bfloat16), layer.biases.astype(mx.bfloat16)
    packed = [kernels.packed_weight(layer) for layer in layers]
    dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=bits) for w in packed]
    a = [mx.random.normal((inp, r), key=k[0]) / 8] * 2
    b = [mx.random.normal((r, out), key=k[1]) / 8] * 2
    m = [mx.random.uniform(0.5, 2.0, (out,), key=k[2])] * 2
    want = kernels.row_norms_and_scaled_cuda(dense, a, b, [S, 2 * S], m, stacked=True)
    got = kernels.row_norms_and_scaled_cuda(packed, a, b, [S, 2 * S], m, stacked=True)
    for name, gots, wants in zip(("norm", "W'", "rs", "A", "B'"), got, want):
        for x, v in zip(gots, wants):
            x, v = (x.view(), v.view()) if name == "norm" else (x, v)
            assert x.dtype == v.dtype and mx.allclose(x.astype(mx.float32), v.astype(mx.float32), rtol=1e-2,
                                                      atol=1e-5).item(), name
    g = mx.random.normal((4096, out), key=k[3]).astype(mx.bfloat16)
    y = mx.random.normal((4096, out), key=k[4]).astype(mx.bfloat16)
    u = mx.random.normal((4096, r), key=k[5]).astype(mx.bfloat16)
    norm = got[0][1]
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m[1], norm, 2 * S)
    want_dm, want_gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m[1], norm.view(), 2 * S)
    assert mx.array_equal(dm, want_dm).item() and mx.array_equal(gb, want_gb).item()
    rs = (m[1] / norm.view()).astype(mx.bfloat16).astype(mx.float32)
    product = ((2 * S) * (u.T @ g)).astype(mx.float32) * rs
    assert mx.allclose(gb, product, rtol=2e-2, atol=1e-2 * mx.abs(product).max().item()).item()


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="CUDA kernels")
@pytest.mark.parametrize("out, inp, bits", [(6144, 2048, 0), (2048, 6144, 0), (6144, 2048, 4), (2048, 6144, 4)])
def test_merged_folded_launch_on_cuda(out, inp, bits):
    """The merged folded launch at the 1B model's shapes (A resident for 2048 columns, staged for 6144), bf16 and 4-bit
    read packed: W' is rs (W + s (A B)^T) to bfloat16 rounding, and the norms, rs, A and B' are the unmerged
    launch's bits."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(9), 6)
    linears = [nn.Linear(inp, out, bias=False) for _ in range(2)]
    if bits:
        layers = [nn.QuantizedLinear.from_linear(layer, group_size=64, bits=bits) for layer in linears]
        for layer in layers:
            layer.scales, layer.biases = layer.scales.astype(mx.bfloat16), layer.biases.astype(mx.bfloat16)
        ws = [kernels.packed_weight(layer) for layer in layers]
        dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=bits) for w in ws]
    else:
        ws = dense = [layer.weight.astype(mx.bfloat16) for layer in linears]
    a = [mx.random.normal((inp, 8), key=k[i]) / 8 for i in (0, 1)]
    b = [mx.random.normal((8, out), key=k[i]) / 8 for i in (2, 3)]
    m = [mx.random.uniform(0.5, 2.0, (out,), key=k[i]) for i in (4, 5)]
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, [S, 2 * S], m, merged=True)
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, [S, 2 * S], m)
    for name, gots, wants in zip(("norm", "rs", "A", "B'"), (got[0], *got[2:]), (want[0], *want[2:])):
        for x, v in zip(gots, wants):
            assert mx.array_equal(x, v).item(), name
    for w, a_l, b_l, s, rs, merged in zip(dense, a, b, [S, 2 * S], got[2], got[1]):
        reference = rs[:, None] * (w.astype(mx.float32) + s * (a_l @ b_l).T)
        assert merged.dtype == mx.bfloat16
        # A staged (6144 columns) stores d = W + s (A B)^T in bfloat16, then rs d: two roundings (dora_row_norms.cuh)
        assert mx.allclose(merged.astype(mx.float32), reference, rtol=2 ** -6, atol=1e-6).item()


def test_row_norm_matches_dense_norm():
    from meshtune.adapters.adapted_linear import adapted_row_norm

    k = mx.random.split(mx.random.key(0), 3)
    w = mx.random.normal((40, 70), key=k[0]) / 8
    a = mx.random.normal((70, 8), key=k[1]) / 8
    b = mx.random.normal((8, 40), key=k[2]) / 8
    dense = w + S * (b.T @ a.T)
    want = 1 / mx.sqrt((dense * dense).sum(-1))
    got = 1 / adapted_row_norm((w * w).sum(-1), w @ a, b.T, a.T @ a, S)
    assert mx.allclose(got, want, rtol=1e-4).item()
