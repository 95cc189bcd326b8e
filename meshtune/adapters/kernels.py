"""DoRA's per-layer extra work as CUDA kernels, for MLX's CUDA build.

DoRA adds to each layer's step the norm of the adapted rows (forward) and m's
gradient with the row-scaled cotangent (backward). Each is a few MLX operations, and
the host's dispatch is a large part of a GPU step (scripts/probes/dispatch_cost.py:
~60%), so each gets as few launches as the GPU's time allows:

- `row_scale_cuda` (forward): W A's r columns for the block's rows (W read once, A
  staged through shared memory), A's r x r Gram from the same tiles, then
  ||W + s (A B)^T||_row by the identity in DESIGN.md and rs = m / that norm, in the
  activations' dtype. It takes the place of a skinny matmul, the Gram's matmul and
  the norm's small operations.
- `cotangent_cuda` (backward): the row-scaled cotangent g * rs and m's column sums
  sum_t g * y in one pass over g and y, 16-byte accesses, blocks of columns by chunks
  of rows (a block per column strip gave a 1024-wide layer 32 blocks for 132 SMs);
  a second small kernel adds the chunks' sums in a fixed order, so the result does not
  depend on scheduling, and divides by rs * norm.

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
            #pragma unroll 4
            for (int j = lane; j < n; j += 32) {  // several loads of W in flight
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
    // Block: 8 warps on 32 * VEC columns, a thread on VEC consecutive columns (one 16-byte
    // access where aligned), the warps striding over the block's chunk of rows. Each
    // block's column sums go to its row of `part`, added in a fixed order.
    struct alignas(sizeof(T) * VEC) Vec { T v[VEC]; };
    constexpr int CB = 32 * VEC;
    __shared__ float sums[8][CB];
    int tid = threadIdx.x;
    int lane = tid & 31;
    int warp = tid >> 5;
    int c0 = blockIdx.x * CB + lane * VEC;
    int t0 = blockIdx.y * CHUNK;
    int t1 = min(t0 + CHUNK, ROWS);
    bool aligned = VEC > 1 && (reinterpret_cast<unsigned long long>(g) % sizeof(Vec) == 0)
        && (reinterpret_cast<unsigned long long>(y) % sizeof(Vec) == 0)
        && (reinterpret_cast<unsigned long long>(gz) % sizeof(Vec) == 0);
    float acc[VEC];
    float r[VEC];
    for (int v = 0; v < VEC; ++v) {
        acc[v] = 0.0f;
        r[v] = c0 + v < COLS ? static_cast<float>(rs[c0 + v]) : 0.0f;
    }
    if (c0 < COLS) {  // COLS is a multiple of VEC: a thread's columns are all in or all out
        for (int t = t0 + warp; t < t1; t += 8) {
            long long off = (long long)t * COLS + c0;
            Vec gv, yv, out;
            if (aligned) {
                gv = *reinterpret_cast<const Vec*>(g + off);
                yv = *reinterpret_cast<const Vec*>(y + off);
            } else {
                for (int v = 0; v < VEC; ++v) {
                    gv.v[v] = g[off + v];
                    yv.v[v] = y[off + v];
                }
            }
            for (int v = 0; v < VEC; ++v) {
                float gf = static_cast<float>(gv.v[v]);
                acc[v] += gf * static_cast<float>(yv.v[v]);
                out.v[v] = static_cast<T>(gf * r[v]);
            }
            if (aligned) {
                *reinterpret_cast<Vec*>(gz + off) = out;
            } else {
                for (int v = 0; v < VEC; ++v) gz[off + v] = out.v[v];
            }
        }
    }
    for (int v = 0; v < VEC; ++v) sums[warp][lane * VEC + v] = acc[v];
    __syncthreads();
    for (int c = tid; c < CB; c += 256) {
        int col = blockIdx.x * CB + c;
        if (col < COLS) {
            float total = 0.0f;
            for (int k = 0; k < 8; ++k) total += sums[k][c];
            part[(long long)blockIdx.y * COLS + col] = total;
        }
    }
"""

# m's gradient from the chunks' column sums: a thread per column, chunks added in order.
_MAGNITUDE_GRAD = """
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col < COLS) {
        float sum = 0.0f;
        for (int k = 0; k < CHUNKS; ++k) sum += part[(long long)k * COLS + col];
        float den = static_cast<float>(rs[col]) * norm[col];
        dm[col] = den == 0.0f ? 0.0f : sum / den;
    }
"""

# Cotangent blocks to aim for: ~4 per SM of an H200 (132 SMs), a chunk at least 32 rows.
_COTANGENT_BLOCKS = 528

# The largest rank the row-scale kernel takes (its accumulators live in registers);
# adapted_linear computes larger ones in MLX ops.
MAX_RANK = 64


def _a_tile_rows(r: int) -> int:
    """Rows of A a shared-memory tile holds: 32 KiB of float32 (16 KiB at r = 64, beside its
    16 KiB Gram, under the 48 KiB a block may hold statically), a multiple of 32. Each tile
    is a global load, a barrier and a pass: few large tiles keep a block's chain short
    (2 tiles for a 2048-wide input at r = 8)."""
    floats = 8192 if r <= 32 else 4096
    return max(32, floats // r // 32 * 32)


def row_scale_cuda(weight: mx.array, a: mx.array, b: mx.array, w_sq: mx.array, m: mx.array,
                   scale: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(||W + s (A B)^T||_row float32, rs = m / that in `dtype`) for W (out, in), A (in, r), B (r, out)."""
    out, inp = weight.shape
    r = a.shape[-1]
    # WT (like YT and RT below), unused in the source, puts an input's dtype in the name MLX
    # caches the compiled kernel by (the inputs' dtypes are not in it): a float32 W must not
    # run a bfloat16 W's kernel.
    k = _kernel("meshtune_dora_row_scale", ["w", "a", "b", "w_sq", "m", "s"], ["norm", "rs"], _ROW_SCALE)
    blocks = -(-out // _WARPS)
    norm, rs = k(inputs=[weight, a.astype(mx.float32), b.astype(mx.float32), w_sq, m.astype(mx.float32),
                         mx.array([scale], dtype=mx.float32)],
                 template=[("R", r), ("IN", inp), ("OUT", out), ("WARPS", _WARPS),
                           ("TJ", _a_tile_rows(r)), ("T", dtype), ("WT", weight.dtype)],
                 grid=(blocks * _WARPS * 32, 1, 1), threadgroup=(_WARPS * 32, 1, 1),
                 output_shapes=[(out,), (out,)], output_dtypes=[mx.float32, dtype])
    return norm, rs


def cotangent_cuda(g: mx.array, y: mx.array, rs: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y."""
    rows, cols = g.shape
    vec = 16 // g.dtype.size
    vec = vec if cols % vec == 0 else 1
    strips = -(-cols // (32 * vec))
    chunk = -(-rows // max(1, min(-(-_COTANGENT_BLOCKS // strips), rows // 32)))
    chunks = -(-rows // chunk)
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "rs"], ["gz", "part"], _COTANGENT)
    gz, part = k(inputs=[g, y, rs], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                              ("T", g.dtype), ("YT", y.dtype), ("RT", rs.dtype)],
                 grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                 output_shapes=[(rows, cols), (chunks, cols)], output_dtypes=[g.dtype, mx.float32])
    k = _kernel("meshtune_dora_magnitude_grad", ["part", "rs", "norm"], ["dm"], _MAGNITUDE_GRAD)
    (dm,) = k(inputs=[part, rs, norm], template=[("COLS", cols), ("CHUNKS", chunks), ("RT", rs.dtype)],
              grid=(-(-cols // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
              output_shapes=[(cols,)], output_dtypes=[mx.float32])
    return gz, dm
