"""DoRA's per-layer small steps as one CUDA kernel each, for MLX's CUDA build.

DoRA adds small operations per layer to LoRA's (casts, the r x r products, a reduction,
divides, the row scale, m's column sum). Two kernels take the place of most of them:

- `row_scale_cuda`: from the r rows A^T W^T of the base product, ||W + s (A B)^T||_row
  and rs = m / that norm in the activations' dtype; a thread per output row, A's
  r x r Gram summed in each block (no matmul dispatched for it).
- `cotangent_cuda`: the row-scaled cotangent g * rs and m's gradient
  sum_t g * y / (rs * norm) in one pass over g and y; blocks of 32 columns by a chunk
  of rows, whose partial sums are added in a fixed order, so the result does not
  depend on scheduling.

Elsewhere (CPU, Metal) adapted_linear computes the same in MLX ops; tests compare
the two on a GPU (tests/test_adapted_linear.py). Measured in the whole 1B model on an
H200 (scripts/probe_dora_step.py, one run): 66.4 ms a step with the kernels, 67.5 ms
with the MLX ops, LoRA 50.5 ms. Most of DoRA's earlier excess was its base row norms
recomputed every step (dora.py now evaluates them when the base is set).
"""

from __future__ import annotations

import mlx.core as mx

from ..cuda import kernel as _kernel, on_cuda  # noqa: F401 (on_cuda: adapted_linear asks here)

_ROW_SCALE = """
    // A's r x r Gram into shared memory: summed here from A (in, r) when GRAM_INSIDE
    // (each block from the whole A, in segments added in a fixed order), else copied from
    // a precomputed Gram passed in A's place.
    __shared__ float part[GRAM_INSIDE ? R * R * SEG : 1];
    __shared__ float G[R * R];
    int tid = threadIdx.x;
    if (GRAM_INSIDE) {
        for (int e = tid; e < R * R * SEG; e += blockDim.x) {
            int kl = e / SEG;
            int k = kl / R;
            int l = kl - k * R;
            float acc = 0.0f;
            for (int j = e - kl * SEG; j < IN; j += SEG) acc += a[j * R + k] * a[j * R + l];
            part[e] = acc;
        }
        __syncthreads();
        for (int e = tid; e < R * R; e += blockDim.x) {
            float acc = 0.0f;
            for (int q = 0; q < SEG; ++q) acc += part[e * SEG + q];
            G[e] = acc;
        }
    } else {
        for (int e = tid; e < R * R; e += blockDim.x) G[e] = a[e];
    }
    __syncthreads();
    int i = blockIdx.x * blockDim.x + tid;
    if (i < OUT) {
        float c[R];
        float cross = 0.0f;
        for (int k = 0; k < R; ++k) {
            c[k] = b[k * OUT + i];
            cross += c[k] * static_cast<float>(p[k * OUT + i]);
        }
        float quad = 0.0f;
        for (int k = 0; k < R; ++k) {
            float t = 0.0f;
            for (int l = 0; l < R; ++l) t += G[k * R + l] * c[l];
            quad += c[k] * t;
        }
        float sc = s[0];
        float n = sqrtf(fmaxf(w_sq[i] + 2.0f * sc * cross + sc * sc * quad, 0.0f));
        norm[i] = n;
        rs[i] = static_cast<T>(m[i] / n);
    }
"""

# A block per 32 columns and a chunk of rows (enough chunks for ~4 blocks per SM: a block
# per 32 columns alone gave a 2048-wide layer 64 blocks on 132 SMs and took 3.5x as long as
# g * rs); each block's 8 warps add their sums in a fixed order into one partial row, and
# `cotangent_cuda` adds the partial rows (a deterministic reduction).
_COTANGENT = """
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int col = blockIdx.x * 32 + lane;
    int t0 = blockIdx.y * CHUNK;
    int t1 = min(t0 + CHUNK, ROWS);
    __shared__ float sums[8][33];
    float acc = 0.0f;
    if (col < COLS) {
        float r = static_cast<float>(rs[col]);
        for (int t = t0 + warp; t < t1; t += 8) {
            float gv = static_cast<float>(g[(long long)t * COLS + col]);
            acc += gv * static_cast<float>(y[(long long)t * COLS + col]);
            gz[(long long)t * COLS + col] = static_cast<T>(gv * r);
        }
    }
    sums[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && col < COLS) {
        float total = 0.0f;
        for (int k = 0; k < 8; ++k) total += sums[k][lane];
        part[blockIdx.y * COLS + col] = total;
    }
"""

# Blocks to aim for: about 4 per SM of an H200 (132 SMs).
_COTANGENT_BLOCKS = 528

# The row-scale kernel keeps the r x r Gram in shared memory (r <= 64: 16 KiB). Up to
# GRAM_INSIDE_MAX_RANK it sums the Gram itself (r^2 x in products a block: 512 a thread at
# r = 8, in = 2048), saving a matmul's dispatch per layer; above, a matmul computes it.
MAX_RANK = 64
GRAM_INSIDE_MAX_RANK = 16


def row_scale_cuda(proj_rows: mx.array, a: mx.array, b: mx.array, w_sq: mx.array, m: mx.array,
                   scale: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(norm float32, rs in `dtype`) per output row from proj_rows = A^T W^T (r, out), A (in, r), B (r, out).

    For r <= MAX_RANK (the caller's check).
    """
    r, out = proj_rows.shape
    a = a.astype(mx.float32)
    inside = r <= GRAM_INSIDE_MAX_RANK
    k = _kernel("meshtune_dora_row_scale", ["p", "a", "b", "w_sq", "m", "s"], ["norm", "rs"], _ROW_SCALE)
    norm, rs = k(inputs=[proj_rows, a if inside else a.T @ a, b.astype(mx.float32), w_sq, m.astype(mx.float32),
                         mx.array([scale], dtype=mx.float32)],
                 template=[("R", r), ("IN", a.shape[0]), ("OUT", out), ("SEG", max(1, 1024 // (r * r))),
                           ("GRAM_INSIDE", int(inside)), ("T", dtype)],
                 grid=(((out + 255) // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                 output_shapes=[(out,), (out,)], output_dtypes=[mx.float32, dtype])
    return norm, rs


def cotangent_cuda(g: mx.array, y: mx.array, rs: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y."""
    rows, cols = g.shape
    strips = (cols + 31) // 32
    chunk = -(-rows // max(1, min(rows // 8, -(-_COTANGENT_BLOCKS // strips))))
    chunks = -(-rows // chunk)
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "rs"], ["gz", "part"], _COTANGENT)
    gz, part = k(inputs=[g, y, rs], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("T", g.dtype)],
                 grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                 output_shapes=[(rows, cols), (chunks, cols)], output_dtypes=[g.dtype, mx.float32])
    den = rs.astype(mx.float32) * norm
    return gz, mx.where(den == 0, 0.0, part.sum(axis=0) / mx.where(den == 0, 1.0, den))
