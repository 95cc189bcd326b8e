"""DoRA's training product with the row scale folded into the weights, for the probes to time.

Development code (adapters issue): not used by meshtune. DoRA's step on an H200 carries ~1.9 ms
of GPU time per 1024 tokens over LoRA's, and the token-sized passes it adds (the forward's row
scale, the cotangent's g * rs) explain about half of it (docs/bench/overlapped_batches_h200.txt).
Here those passes go: with rs = m / norm (a constant of the step, DoRA section 4.3),

    y = rs * (x W^T + s (x A) B) = x W'^T + s (x A) B',   W' = rs W (rows),  B' = B rs (columns),

so the forward and backward are LoRA's on W' and B' (dx = g W' + s (g B'^T) A^T, dA = s x^T (g B'^T),
dB = s ((x A)^T g) rs), and m's gradient sum_t g y / (rs * norm) is the only token-sized pass
DoRA adds: on CUDA the cotangent kernel with its g * rs write cut out (`magnitude_grad`).
W' costs one pass over W a step (here an MLX multiply a layer; a kernel could write it beside
the norm) and a dense copy of the adapted weights for the step.
"""

import mlx.core as mx

from meshtune.adapters import kernels as K
from meshtune.adapters.adapted_linear import dora_cotangent

# The cotangent kernel without its g * rs output: column sums of g * y by chunks of rows.
_GZ_WRITE = """            for (int v = 0; v < VEC; ++v) {
                float gf = static_cast<float>(gv.v[v]);
                acc[v] += gf * static_cast<float>(yv.v[v]);
                out.v[v] = static_cast<T>(gf * r[v]);
            }
            if (aligned) {
                *reinterpret_cast<Vec*>(gz + off) = out;
            } else {
                for (int v = 0; v < VEC; ++v) gz[off + v] = out.v[v];
            }"""
_SUMS_ONLY = """            for (int v = 0; v < VEC; ++v)
                acc[v] += static_cast<float>(gv.v[v]) * static_cast<float>(yv.v[v]);"""
_GZ_ALIGNED = "\n        && (reinterpret_cast<unsigned long long>(gz) % sizeof(Vec) == 0);"
assert _GZ_WRITE in K._COTANGENT and _GZ_ALIGNED in K._COTANGENT, "kernels._COTANGENT changed: update the probe"
_COLUMN_SUMS = K._COTANGENT.replace(_GZ_WRITE, _SUMS_ONLY).replace(_GZ_ALIGNED, ";").replace(
    "Vec gv, yv, out;", "Vec gv, yv;")


def magnitude_grad(g, y, m, norm):
    """sum_t g * y / (rs * norm) float32 with rs = m / norm rounded to g's dtype (0 where that is 0)."""
    if not K.on_cuda():
        return dora_cotangent(g, y, (m / norm).astype(g.dtype), norm)[1]
    rows, cols = g.shape
    vec, strips, chunk, chunks = K.cotangent_grid(rows, cols, g.dtype)
    k = K._kernel("meshtune_probe_column_sums", ["g", "y", "m", "norm"], ["part"], _COLUMN_SUMS)
    (part,) = k(inputs=[g, y, m.astype(mx.float32), norm],
                template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec), ("T", g.dtype), ("YT", y.dtype)],
                grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                output_shapes=[(chunks, cols)], output_dtypes=[mx.float32])
    k = K._kernel("meshtune_dora_magnitude_grad", ["part", "m", "norm"], ["dm"], K._MAGNITUDE_GRAD)
    (dm,) = k(inputs=[part, m.astype(mx.float32), norm], template=[("COLS", cols), ("CHUNKS", chunks), ("T", g.dtype)],
              grid=(-(-cols // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
              output_shapes=[(cols,)], output_dtypes=[mx.float32])
    return dm


def scaled_weight_linear(x, weight, a, b, scale, m, norm, w_scaled=None):
    """DoRA's rs * (x W^T + s (x A) B) for x (..., in), W (out, in), A (in, r), B (r, out), m and norm (out,),
    as LoRA's product on W' = rs W and B' = B rs; the norm is a constant. `w_scaled` is W' where
    the caller has it (`row_norms_and_scaled_weights`); otherwise an MLX multiply makes it."""
    lead, dt = x.shape[:-1], x.dtype
    norm = mx.stop_gradient(norm)
    x2 = x.reshape(-1, x.shape[-1])
    given = w_scaled

    @mx.custom_function
    def product(x2, a, b, m):
        rs = (m / norm).astype(dt)
        w_scaled = given if given is not None else rs[:, None] * weight
        b_scaled = (b * rs.astype(mx.float32)).astype(dt)
        return [x2 @ w_scaled.T + (scale * ((x2 @ a.astype(dt)) @ b_scaled)).astype(dt), w_scaled, b_scaled]

    @product.vjp
    def product_vjp(primals, cotangents, outputs):
        x2, a, b, m = primals
        g, (y, w_scaled, b_scaled) = cotangents[0], outputs
        rs = (m / norm).astype(dt)
        ac = a.astype(dt)
        gxa = g @ b_scaled.T
        ga = (scale * (x2.T @ gxa)).astype(a.dtype)
        gb = ((scale * ((x2 @ ac).T @ g)).astype(mx.float32) * rs.astype(mx.float32)).astype(b.dtype)
        dx = mx.addmm(g @ w_scaled, gxa, ac.T, alpha=scale)
        return [dx, ga, gb, magnitude_grad(g, y, m, norm).astype(m.dtype)]

    return product(x2, a, b, m)[0].reshape(*lead, -1)


# The row-norm kernel writing W' = rs W too: once a warp has a row's norm (every lane holds the
# butterfly's sum), it reads the row again (from the L2 cache, just read) and writes rs * w with
# rs = m / norm rounded to W's dtype, as the MLX ops round it.
_WRITE_SCALED = """
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int q = 0; q < RPW; ++q) {
            int i = first_row(g) + q;
            if (i >= OUT) continue;
            float rs = static_cast<float>(static_cast<WT>(mm[i] / sqrtf(sq[g][q])));
            for (int c = lane * VEC; c < IN; c += 32 * VEC) {
                long long off = (long long)i * IN + c;
                WVec in, out;
                if (aligned) {
                    in = *reinterpret_cast<const WVec*>(w + off);
                } else {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) in.v[v] = w[off + v];
                }
                #pragma unroll
                for (int v = 0; v < VEC; ++v) out.v[v] = static_cast<WT>(rs * static_cast<float>(in.v[v]));
                if (aligned) {
                    *reinterpret_cast<WVec*>(ws + off) = out;
                } else {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) ws[off + v] = out.v[v];
                }
            }
        }
"""
_NORM_STORE = "            if (lane == q && i < OUT) norm[i] = sqrtf(sq[g][q]);\n        }\n"
assert K._ROW_NORM.endswith(_NORM_STORE), "kernels._ROW_NORM changed: update the probe"


def _scaled_source(layers):
    select = "\n".join(f"        case {i}: w = w{i}; a = a{i}; b = b{i}; mm = m{i}; norm = norm{i}; ws = ws{i}; break;"
                       for i in range(layers))
    body = K._ROW_NORM.replace("    float* norm;\n", "    float* norm;\n    const float* mm;\n    WT* ws;\n")
    # ws's alignment joins w's: one aligned flag for both.
    body = body.replace("bool aligned = VEC > 1 && reinterpret_cast<unsigned long long>(w) % sizeof(WVec) == 0;",
                        "bool aligned = VEC > 1 && reinterpret_cast<unsigned long long>(w) % sizeof(WVec) == 0;\n"
                        "    aligned = aligned && reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0;")
    body = body.replace("@SELECT@", f"switch (blockIdx.y) {{\n{select}\n        default: return;\n    }}")
    return body + _WRITE_SCALED


def row_norms_and_scaled_weights(weights, a, b, scales, ms):
    """(norms float32, W' = rs W in W's dtype) of layers of one shape, one launch; the norms as
    kernels.row_norms_cuda's. MLX ops where CUDA is not."""
    if not K.on_cuda():
        norms = [mx.linalg.norm(w.astype(mx.float32) + s * (x @ y).T, axis=-1) for w, x, y, s in zip(weights, a, b, scales)]
        return norms, [(m / n).astype(w.dtype)[:, None] * w for w, m, n in zip(weights, ms, norms)]
    n = len(weights)
    out, inp = weights[0].shape
    r = a[0].shape[-1]
    names = [f"{p}{i}" for p in ("w", "a", "b", "m") for i in range(n)]
    k = K._kernel(f"meshtune_probe_row_norm_scaled_{n}", names + ["s"], [f"norm{i}" for i in range(n)]
                  + [f"ws{i}" for i in range(n)], _scaled_source(n))
    rows, vec, tile = K._row_scale_layout(r, inp, weights[0].dtype.size)
    blocks = -(-out // (K._WARPS * rows * K._ROW_GROUPS))
    res = k(inputs=[*weights, *(x.astype(mx.float32) for x in a), *(y.astype(mx.float32) for y in b),
                    *(m.astype(mx.float32) for m in ms), mx.array(scales, dtype=mx.float32)],
            template=[("R", r), ("IN", inp), ("OUT", out), ("WARPS", K._WARPS), ("RPW", rows), ("VEC", vec),
                      ("TJ", tile), ("G", K._ROW_GROUPS), ("WT", weights[0].dtype)],
            grid=(blocks * K._WARPS * 32, n, 1), threadgroup=(K._WARPS * 32, 1, 1),
            output_shapes=[(out,)] * n + [(out, inp)] * n, output_dtypes=[mx.float32] * n + [weights[0].dtype] * n)
    return res[:n], res[n:]
