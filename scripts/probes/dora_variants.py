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
- `grouped_row_norms(groups)`: kernels.row_norms_cuda with each block on `groups` groups of
  its rows, every staged tile of A serving them all (the kernel stages A once per 16 rows:
  as many bytes of A through shared memory as of W). Same sums in the same order.
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


_GROUPED_ROW_NORM = """
    // Block: WARPS warps, RPW adjacent rows of W each (in G groups), of layer blockIdx.y: the launch takes
    // L layers of one shape, and a switch (written by row_norms_cuda) points w, a, b, norm
    // and sc at that layer's arrays and scale. The norm is taken row by row without
    // storing the adapted row: element j is d_j = w_ij + s sum_k A_jk B_ki, and the lanes
    // sum d_j^2 over the columns they take (no Gram, no w_sq, no cancellation between the
    // identity's terms). Tiles of TJ rows of A pass through shared memory transposed, padded
    // (sa[k * SA + j], SA = TJ + 4: staging writes hit distinct banks); a lane takes VEC
    // consecutive columns per pass (a 16-byte load of each of its rows, all of a tile's loads
    // issued before its arithmetic) and reads A's values for them as float4s, half-swizzled
    // so a quarter-warp's reads hit distinct banks; each value read serves RPW rows.
    struct alignas(sizeof(WT) * VEC) WVec { WT v[VEC]; };
    constexpr int NT = WARPS * 32;
    constexpr int SA = TJ + 4;
    constexpr int P = TJ / (32 * VEC);  // passes over a full tile
    __shared__ float4 sa4[R * SA / 4];
    float* sa = reinterpret_cast<float*>(sa4);
    int tid = threadIdx.x;
    int lane = tid & 31;
    const WT* w;
    const float* a;
    const float* b;
    float* norm;
    @SELECT@
    float sc = s[blockIdx.y];
    bool aligned = VEC > 1 && reinterpret_cast<unsigned long long>(w) % sizeof(WVec) == 0;
    // The block's rows: G groups of WARPS * RPW, a warp's RPW adjacent rows in each; every
    // staged tile of A serves all G groups (one group: A staged once for WARPS * RPW rows).
    auto first_row = [&](int g) { return ((blockIdx.x * G + g) * WARPS + (tid >> 5)) * RPW; };
    float sq[G][RPW];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int q = 0; q < RPW; ++q) sq[g][q] = 0.0f;
    WVec wr[P][RPW];
    auto load_w = [&](int row0, int j0, int n) {
        #pragma unroll
        for (int p = 0; p < P; ++p) {
            int c = p * 32 * VEC + lane * VEC;
            #pragma unroll
            for (int q = 0; q < RPW; ++q) {
                long long off = (long long)(row0 + q) * IN + j0 + c;
                if (row0 + q >= OUT || c >= n) {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) wr[p][q].v[v] = static_cast<WT>(0.0f);
                } else if (aligned) {
                    wr[p][q] = *reinterpret_cast<const WVec*>(w + off);
                } else {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) wr[p][q].v[v] = w[off + v];
                }
            }
        }
    };
    for (int j0 = 0; j0 < IN; j0 += TJ) {
        int n = min(TJ, IN - j0);  // a multiple of VEC (IN and TJ are)
        load_w(first_row(0), j0, n);  // the first group's loads in flight while A is staged
        for (int e = tid; e < n * R; e += NT) sa[(e % R) * SA + e / R] = a[(long long)j0 * R + e];
        __syncthreads();
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            int row0 = first_row(g);
            if (g > 0) load_w(row0, j0, n);
            float cb[RPW][R];  // s * B's column for each of the warp's rows in this group
            #pragma unroll
            for (int q = 0; q < RPW; ++q)
                #pragma unroll
                for (int k = 0; k < R; ++k) cb[q][k] = row0 + q < OUT ? sc * b[k * OUT + row0 + q] : 0.0f;
            #pragma unroll
            for (int p = 0; p < P; ++p) {
                int c = p * 32 * VEC + lane * VEC;
                if (c < n) {
                    float t[RPW][VEC];
                    #pragma unroll
                    for (int q = 0; q < RPW; ++q)
                        #pragma unroll
                        for (int v = 0; v < VEC; ++v) t[q][v] = static_cast<float>(wr[p][q].v[v]);
                    #pragma unroll
                    for (int k = 0; k < R; ++k) {
                        float av[VEC];
                        if (VEC >= 4) {
                            #pragma unroll
                            for (int h = 0; h < VEC / 4; ++h) {
                                int part = VEC == 8 ? h ^ ((lane >> 2) & 1) : h;
                                float4 f = sa4[(k * SA + c) / 4 + part];
                                av[part * 4] = f.x;
                                av[part * 4 + 1] = f.y;
                                av[part * 4 + 2] = f.z;
                                av[part * 4 + 3] = f.w;
                            }
                        } else {
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) av[v] = sa[k * SA + c + v];
                        }
                        #pragma unroll
                        for (int q = 0; q < RPW; ++q)
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) t[q][v] += av[v] * cb[q][k];
                    }
                    #pragma unroll
                    for (int q = 0; q < RPW; ++q)
                        #pragma unroll
                        for (int v = 0; v < VEC; ++v) sq[g][q] += t[q][v] * t[q][v];
                }
            }
        }
        __syncthreads();
    }
    // Each row's sum over the warp's lanes by a fixed butterfly (deterministic).
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int q = 0; q < RPW; ++q) {
            for (int off = 16; off > 0; off >>= 1) sq[g][q] += __shfl_xor_sync(0xffffffff, sq[g][q], off);
            int i = first_row(g) + q;
            if (lane == q && i < OUT) norm[i] = sqrtf(sq[g][q]);
        }
"""


def grouped_row_norms(groups):
    """kernels.row_norms_cuda with `groups` groups of rows a block."""
    def row_norms(weights, a, b, scales):
        n = len(weights)
        out, inp = weights[0].shape
        r = a[0].shape[-1]
        names = [f"{p}{i}" for p in ("w", "a", "b") for i in range(n)]
        k = K._kernel(f"probe_dora_row_norm_grouped_{n}", names + ["s"], [f"norm{i}" for i in range(n)],
                      K._row_norm_source(n, _GROUPED_ROW_NORM))
        rows, vec, tile = K._row_scale_layout(r, inp, weights[0].dtype.size)
        blocks = -(-out // (K._WARPS * rows * groups))
        return k(inputs=[*weights, *(x.astype(mx.float32) for x in a), *(y.astype(mx.float32) for y in b),
                         mx.array(scales, dtype=mx.float32)],
                 template=[("R", r), ("IN", inp), ("OUT", out), ("WARPS", K._WARPS), ("RPW", rows), ("VEC", vec),
                           ("TJ", tile), ("G", groups), ("WT", weights[0].dtype)],
                 grid=(blocks * K._WARPS * 32, n, 1), threadgroup=(K._WARPS * 32, 1, 1),
                 output_shapes=[(out,)] * n, output_dtypes=[mx.float32] * n)
    return row_norms
