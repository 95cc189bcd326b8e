"""DoRA's per-layer extra work as one CUDA kernel each way, for MLX's CUDA build.

A GPU training step of the 1B bench model spends most of its time dispatching kernels
from the host (scripts/probes/dispatch_cost.py: ~60%), and each kernel a layer adds
costs about as much host time as a large matmul: what DoRA adds to LoRA is counted
in launches more than in bytes. So each direction gets one kernel:

- `row_scale_cuda` (forward): W A's r columns for the block's rows (W read once, A
  staged through shared memory), A's r x r Gram from the same tiles, then
  ||W + s (A B)^T||_row by the identity in DESIGN.md and rs = m / that norm, in the
  activations' dtype. It takes the place of a skinny matmul, the Gram's matmul and
  the norm's small operations.
- `cotangent_cuda` (backward): the row-scaled cotangent g * rs and m's gradient
  sum_t g * y / (rs * norm) in one pass over g and y; a block per 16 columns whose
  64 partial sums are added in a fixed order, so the result does not depend on
  scheduling.

Elsewhere (CPU, Metal) adapted_linear computes the same in MLX ops; tests compare the
two on a GPU (tests/test_adapted_linear.py).
"""

from __future__ import annotations

import mlx.core as mx

from ..cuda import kernel as _kernel, on_cuda  # noqa: F401 (on_cuda: adapted_linear asks here)

_WARPS = 8  # a row of W per warp, 8 warps a block

_ROW_SCALE = """
    // Block: a row of W per warp. Tiles of TJ rows of A (in, R) pass through shared memory,
    // stored transposed (sa[k][j]) so a warp's lanes read consecutive j. From the same
    // tiles every block sums A's Gram: SPLIT threads per entry, each over every SPLIT-th j.
    __shared__ float sa[TJ * R];
    __shared__ float gpart[WARPS * 32];
    __shared__ float G[R * R];
    constexpr int NT = WARPS * 32;
    constexpr int SPLIT = R * R < NT ? NT / (R * R) : 1;
    constexpr int GPT = (R * R + NT - 1) / NT;  // Gram entries a thread sums (SPLIT == 1)
    int tid = threadIdx.x;
    int lane = tid & 31;
    int i = blockIdx.x * WARPS + (tid >> 5);
    float acc[R];
    #pragma unroll
    for (int k = 0; k < R; ++k) acc[k] = 0.0f;
    float gacc[GPT];
    #pragma unroll
    for (int e = 0; e < GPT; ++e) gacc[e] = 0.0f;
    for (int j0 = 0; j0 < IN; j0 += TJ) {
        int n = min(TJ, IN - j0);
        for (int e = tid; e < n * R; e += NT) sa[(e % R) * TJ + e / R] = a[(long long)j0 * R + e];
        __syncthreads();
        #pragma unroll
        for (int e = 0; e < GPT; ++e) {
            int kl = SPLIT > 1 ? tid / SPLIT : tid + e * NT;
            if (kl < R * R) {
                int k = kl / R;
                int l = kl - k * R;
                float s2 = 0.0f;
                for (int j = SPLIT > 1 ? tid % SPLIT : 0; j < n; j += SPLIT) s2 += sa[k * TJ + j] * sa[l * TJ + j];
                gacc[e] += s2;
            }
        }
        if (i < OUT) {
            for (int j = lane; j < n; j += 32) {
                float wv = static_cast<float>(w[(long long)i * IN + j0 + j]);
                #pragma unroll
                for (int k = 0; k < R; ++k) acc[k] += wv * sa[k * TJ + j];
            }
        }
        __syncthreads();
    }
    if (SPLIT > 1) {
        gpart[tid] = gacc[0];
        __syncthreads();
        if (tid < R * R) {
            float g2 = 0.0f;
            for (int q = 0; q < SPLIT; ++q) g2 += gpart[tid * SPLIT + q];
            G[tid] = g2;
        }
    } else {
        #pragma unroll
        for (int e = 0; e < GPT; ++e)
            if (tid + e * NT < R * R) G[tid + e * NT] = gacc[e];
    }
    // The row's R dot products summed over the warp's lanes (a fixed butterfly: deterministic).
    #pragma unroll
    for (int k = 0; k < R; ++k)
        for (int off = 16; off > 0; off >>= 1) acc[k] += __shfl_xor_sync(0xffffffff, acc[k], off);
    __syncthreads();
    if (lane == 0 && i < OUT) {
        float c[R];
        float cross = 0.0f;
        #pragma unroll
        for (int k = 0; k < R; ++k) {
            c[k] = b[k * OUT + i];
            cross += c[k] * acc[k];
        }
        float quad = 0.0f;
        #pragma unroll
        for (int k = 0; k < R; ++k) {
            float t = 0.0f;
            for (int l = 0; l < R; ++l) t += G[k * R + l] * c[l];
            quad += c[k] * t;
        }
        float sc = s[0];
        float nrm = sqrtf(fmaxf(w_sq[i] + 2.0f * sc * cross + sc * sc * quad, 0.0f));
        norm[i] = nrm;
        rs[i] = static_cast<T>(m[i] / nrm);
    }
"""

_COTANGENT = """
    // Block: 16 columns x 64 row lanes (two per warp); lane sums are added in a fixed order.
    int tid = threadIdx.x;
    int c16 = tid & 15;
    int rl = tid >> 4;
    int col = blockIdx.x * 16 + c16;
    __shared__ float part[64][17];
    float acc = 0.0f;
    if (col < COLS) {
        float r = static_cast<float>(rs[col]);
        for (int t = rl; t < ROWS; t += 64) {
            float gv = static_cast<float>(g[(long long)t * COLS + col]);
            acc += gv * static_cast<float>(y[(long long)t * COLS + col]);
            gz[(long long)t * COLS + col] = static_cast<T>(gv * r);
        }
    }
    part[rl][c16] = acc;
    __syncthreads();
    if (tid < 16 && col < COLS) {
        float sum = 0.0f;
        for (int k = 0; k < 64; ++k) sum += part[k][c16];
        float den = static_cast<float>(rs[col]) * norm[col];
        dm[col] = den == 0.0f ? 0.0f : sum / den;
    }
"""

# The largest rank the row-scale kernel takes (its accumulators live in registers);
# adapted_linear computes larger ones in MLX ops.
MAX_RANK = 64


def row_scale_cuda(weight: mx.array, a: mx.array, b: mx.array, w_sq: mx.array, m: mx.array,
                   scale: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(||W + s (A B)^T||_row float32, rs = m / that in `dtype`) for W (out, in), A (in, r), B (r, out)."""
    out, inp = weight.shape
    r = a.shape[-1]
    k = _kernel("meshtune_dora_row_scale", ["w", "a", "b", "w_sq", "m", "s"], ["norm", "rs"], _ROW_SCALE)
    blocks = -(-out // _WARPS)
    norm, rs = k(inputs=[weight, a.astype(mx.float32), b.astype(mx.float32), w_sq, m.astype(mx.float32),
                         mx.array([scale], dtype=mx.float32)],
                 template=[("R", r), ("IN", inp), ("OUT", out), ("WARPS", _WARPS),
                           ("TJ", max(32, 2048 // r)), ("T", dtype)],
                 grid=(blocks * _WARPS * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
                 output_shapes=[(out,), (out,)], output_dtypes=[mx.float32, dtype])
    return norm, rs


def cotangent_cuda(g: mx.array, y: mx.array, rs: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y."""
    rows, cols = g.shape
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "rs", "norm"], ["gz", "dm"], _COTANGENT)
    gz, dm = k(inputs=[g, y, rs, norm], template=[("ROWS", rows), ("COLS", cols), ("T", g.dtype)],
               grid=(-(-cols // 16) * 1024, 1, 1), threadgroup=(1024, 1, 1),
               output_shapes=[(rows, cols), (cols,)], output_dtypes=[g.dtype, mx.float32])
    return gz, dm
