"""Candidate forms of DoRA's CUDA kernels, for the probes to time beside meshtune/adapters/kernels.py.

Development code (adapters issue): not used by meshtune. Each keeps the current kernel's
body and adds the same finishing step: the blocks that share a result write partial sums,
and the last of them to finish (a ticket from a per-group counter) adds the partials in a
fixed order, so the result does not depend on scheduling and no second launch is needed.
The counters are slices of one persistent zeroed array, each call its own slice (MLX's
CUDA graphs order kernels only by data dependence, so two calls that only read one buffer
may run at once: a shared counter would mix their tickets); each last block resets its
counter, so a slice is zero again when it comes round.
Checked on the CPU by the kernel simulator (tests/cuda_sim), and against the current code
on a GPU by probe_dora_step.py before it times them.

- `one_launch_cotangent`: kernels.cotangent_cuda's blocks (column strips by chunks of
  rows); the last block of a strip writes m's gradient: the magnitude-gradient launch goes.
- `one_launch_magnitude_b_grad`: kernels.magnitude_grad_cuda's folded form (m's and B's
  gradients) in one launch: column_sums' blocks, the last block of a strip adding the chunks
  in the second launch's order (the same bits). On an H200 slower than the two launches
  (112 layers: 3.90 vs 2.98 ms eval, docs/bench/adapters_h200_22.txt).
- `one_launch_magnitude_and_b_sums`: kernels.magnitude_and_b_grad_cuda (B's product in the sums'
  pass) in one launch, on its grid (264 blocks, fewer chunks than above); not yet timed.
"""

import mlx.core as mx

from meshtune.adapters import kernels as K

COUNTERS = mx.zeros((1 << 20,), dtype=mx.uint32)  # ~5000 calls' worth of strips or row groups
mx.eval(COUNTERS)  # held evaluated: a lazy array closed over by a compiled step would be rebuilt each call
_next_counter = 0


def counters(n: int) -> mx.array:
    """A slice of n counters no other call in the same step uses (a compiled step takes its
    slices once, when traced; eager calls go round the pool, thousands of calls apart)."""
    global _next_counter
    if _next_counter + n > COUNTERS.size:
        _next_counter = 0
    start, _next_counter = _next_counter, _next_counter + n
    return COUNTERS[start:start + n]

# After a block's partials are written: fence, take a ticket; the last block runs FINISH.
_LAST_BLOCK = """
    __threadfence();
    __syncthreads();
    __shared__ unsigned int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(const_cast<unsigned int*>(count) + blockIdx.x, 1u);
    __syncthreads();
    if (ticket == gridDim.y - 1) {
        FINISH
        if (threadIdx.x == 0) const_cast<unsigned int*>(count)[blockIdx.x] = 0u;
    }
"""

_COTANGENT_FINISH = """
        for (int c = tid; c < CB; c += 256) {
            int col = blockIdx.x * CB + c;
            if (col < COLS) {
                float sum = 0.0f;
                for (int k = 0; k < (int)gridDim.y; ++k) sum += __ldcg(part + (long long)k * COLS + col);
                float den = row_scale(col) * norm[col];
                dm[col] = den == 0.0f ? 0.0f : sum / den;
            }
        }
"""


def one_launch_cotangent(g, y, m, norm):
    rows, cols = g.shape
    vec, strips, chunk, chunks = K.cotangent_grid(rows, cols, g.dtype)
    k = K._kernel("probe_dora_cotangent_last_block", ["g", "y", "m", "norm", "count"], ["gz", "part", "dm"],
                  K._COTANGENT + _LAST_BLOCK.replace("FINISH", _COTANGENT_FINISH))
    gz, _, dm = k(inputs=[g, y, m.astype(mx.float32), norm, counters(strips)],
                  template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                            ("T", g.dtype), ("YT", y.dtype)],
                  grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(rows, cols), (chunks, cols), (cols,)],
                  output_dtypes=[g.dtype, mx.float32, mx.float32])
    return gz, dm


# m's and B's gradient from the column sums' chunks as kernels.py had it before the sums were spread over a
# block's 8 warps: one thread a column adding every chunk in turn (blocks of 256 columns).
_COLUMN_A_THREAD = """
    const float* norm = norms + off[0];
    RS_FROM_M
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col < COLS) {
        float sum = 0.0f;
        for (int k = 0; k < CHUNKS; ++k) sum += part[(long long)k * COLS + col];
        float rs = row_scale(col);
        float den = rs * norm[col];
        dm[col] = den == 0.0f ? 0.0f : sum / den;
        float sc = static_cast<float>(static_cast<GT>(bscale[0]));
        for (int k = 0; k < R; ++k) {
            long long e = (long long)k * COLS + col;
            gbo[e] = static_cast<float>(static_cast<GT>(sc * static_cast<float>(gb[e]))) * rs;
        }
    }
""".replace("RS_FROM_M", K._RS_FROM_M)


def magnitude_b_grad_a_thread_a_column(g, y, m, norm, b_product, b_scale):
    """kernels.magnitude_grad_cuda(..., b_product=, b_scale=) with the second kernel in its earlier form."""
    part = K.column_sums(g, y)
    chunks, cols = part.shape
    k = K._kernel("probe_dora_magnitude_b_grad_a_thread_a_column", ["part", "m", "norms", "off", "gb", "bscale"],
                  ["dm", "gbo"], _COLUMN_A_THREAD)
    r = b_product.shape[0]
    inputs = [part, m.astype(mx.float32), norm, K.kernel_constant([0], mx.int32), b_product,
              K.kernel_constant([b_scale], mx.float32)]
    return k(inputs=inputs, template=[("COLS", cols), ("CHUNKS", chunks), ("T", g.dtype), ("R", r),
                                      ("GT", b_product.dtype)],
             grid=(-(-cols // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(cols,), (r, cols)], output_dtypes=[mx.float32, mx.float32])


# kernels.magnitude_grad_cuda's folded form in one launch: the last block of a strip adds every chunk's sums as
# kernels._MAGNITUDE_GRAD does (warp j chunks j, j + 8, ...; then the warps in order), then m's and B's gradients
# (d B = s (x A)^T g rs as kernels._B_GRAD forms it: s p rounded to GT, then times rs).
_MAGNITUDE_B_FINISH = """
        auto row_scale = [&](int c) { return static_cast<float>(static_cast<RT>(m[c] / norm[c])); };
        float tot[VEC];
        for (int v = 0; v < VEC; ++v) tot[v] = 0.0f;
        if (c0 < COLS)
            for (int k = warp; k < (int)gridDim.y; k += 8)  // past the L1: other blocks wrote them
                for (int v = 0; v < VEC; ++v) tot[v] += __ldcg(part + (long long)k * COLS + c0 + v);
        for (int v = 0; v < VEC; ++v) sums[warp][lane * VEC + v] = tot[v];
        __syncthreads();
        for (int c = tid; c < CB; c += 256) {
            int col = blockIdx.x * CB + c;
            if (col < COLS) {
                float total = 0.0f;
                for (int j = 0; j < 8; ++j) total += sums[j][c];
                float den = row_scale(col) * norm[col];
                dm[col] = den == 0.0f ? 0.0f : total / den;
            }
        }
        float sc = static_cast<float>(static_cast<GT>(bscale[0]));
        for (int e = tid; e < R * CB; e += 256) {
            int col = blockIdx.x * CB + e % CB;
            if (col < COLS) {
                long long i = (long long)(e / CB) * COLS + col;
                gbo[i] = static_cast<float>(static_cast<GT>(sc * static_cast<float>(gb[i]))) * row_scale(col);
            }
        }
"""
_ONE_LAUNCH_MAGNITUDE_B = ("    const float* norm = norms + off[0];\n" + K._COLUMN_SUMS
                           + _LAST_BLOCK.replace("FINISH", _MAGNITUDE_B_FINISH))


def one_launch_magnitude_b_grad(g, y, m, norm, b_product, b_scale, rs_dtype=None):
    """kernels.magnitude_grad_cuda(g, y, m, norm, b_product=, b_scale=, rs_dtype=) in one launch."""
    rows, cols = g.shape
    vec, strips, chunk, chunks = K.cotangent_grid(rows, cols, g.dtype)
    norms, offset = K._norm_input(norm)
    k = K._kernel("probe_dora_magnitude_b_one_launch",
                  ["g", "y", "m", "norms", "off", "count", "gb", "bscale"], ["part", "dm", "gbo"],
                  _ONE_LAUNCH_MAGNITUDE_B)
    inputs = [g, y, m.astype(mx.float32), norms, offset, counters(strips), b_product,
              K.kernel_constant([b_scale], mx.float32)]
    _, dm, gb = k(inputs=inputs, template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                           ("T", g.dtype), ("YT", y.dtype), ("RT", rs_dtype or g.dtype),
                                           ("R", b_product.shape[0]), ("GT", b_product.dtype)],
                  grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(chunks, cols), (cols,), (b_product.shape[0], cols)],
                  output_dtypes=[mx.float32, mx.float32, mx.float32])
    return dm, gb


# kernels.magnitude_and_b_grad_cuda (B's product in the sums' pass) in one launch: the last block of a strip adds
# the chunks' column sums and B's rows, a thread a column, each in chunk order (not the second kernel's order:
# equal to float32 rounding), then m's gradient and d B = (s p) rs as kernels._B_FROM_SUMS forms them.
_B_SUMS_FINISH = """
        auto row_scale = [&](int c) { return static_cast<float>(static_cast<RT>(m[c] / norm[c])); };
        float sc = static_cast<float>(static_cast<GT>(bscale[0]));
        for (int c = tid; c < CB; c += 256) {
            int col = blockIdx.x * CB + c;
            if (col < COLS) {
                float total = 0.0f;
                for (int q = 0; q < (int)gridDim.y; ++q) total += __ldcg(part + (long long)q * COLS + col);
                float rs = row_scale(col);
                float den = rs * norm[col];
                dm[col] = den == 0.0f ? 0.0f : total / den;
                for (int k = 0; k < R; ++k) {
                    float p = 0.0f;
                    for (int q = 0; q < (int)gridDim.y; ++q) p += __ldcg(bpart + ((long long)q * R + k) * COLS + col);
                    float pr = static_cast<float>(static_cast<GT>(p));
                    gbo[(long long)k * COLS + col] = static_cast<float>(static_cast<GT>(sc * pr)) * rs;
                }
            }
        }
"""
_ONE_LAUNCH_B_SUMS = ("    const float* norm = norms + off[0];\n" + K._COLUMN_AND_B_SUMS
                      + _LAST_BLOCK.replace("FINISH", _B_SUMS_FINISH))


def one_launch_magnitude_and_b_sums(g, y, u, m, norm, b_scale, rs_dtype=None):
    """kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, b_scale, rs_dtype=) in one launch (its grid)."""
    rows, cols = g.shape
    r = u.shape[-1]
    vec, strips, chunk, chunks = K.b_sums_grid(rows, cols, r, g.dtype)
    norms, offset = K._norm_input(norm)
    k = K._kernel("probe_dora_magnitude_b_sums_one_launch",
                  ["g", "y", "u", "m", "norms", "off", "count", "bscale"], ["part", "bpart", "dm", "gbo"],
                  _ONE_LAUNCH_B_SUMS)
    inputs = [g, y, u, m.astype(mx.float32), norms, offset, counters(strips), K.kernel_constant([b_scale], mx.float32)]
    _, _, dm, gb = k(inputs=inputs, template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                              ("R", r), ("T", g.dtype), ("YT", y.dtype), ("UT", u.dtype),
                                              ("RT", rs_dtype or g.dtype), ("GT", g.dtype)],
                     grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                     output_shapes=[(chunks, cols), (chunks, r, cols), (cols,), (r, cols)],
                     output_dtypes=[mx.float32] * 4)
    return dm, gb
