"""DoRA's per-layer extra work as CUDA kernels, for MLX's CUDA build: one kernel each way.

DoRA adds to each layer's step the norm of the adapted rows and the row scale
(forward), and m's gradient with the row-scaled cotangent (backward). On an H200 a
step of the 1B bench model launches ~2300 kernels for LoRA, and each launch costs the
host ~9 us to encode and the GPU a gap (scripts/probes/launch_cost.py,
docs/bench/step_kernels_h200.txt); DoRA's work itself is small. So each direction is
one kernel, in place of the fused elementwise kernel LoRA runs anyway (forward) and of
nothing (backward): a block owns C adjacent output columns (rows of W) and every token,
so it needs no other block's result.

- `dora_forward_cuda`: the block forms its C rows of W + s (A B)^T in registers (a
  thread on adjacent columns of all C rows: A's values read once, W's rows loaded
  together), squares and sums them: ||W + s (A B)^T||_row without storing the adapted
  rows or a Gram (on the CPU and Metal the MLX ops use DESIGN.md's identity instead,
  where W A rides on a product already running). Then rs = m / norm, rounded to the
  activations' dtype, and y = rs * (base + s u) over every token of its columns.
- `cotangent_cuda`: g * rs and sum_t g * y for the block's columns over every token,
  the row lanes' sums added in a fixed order (no atomics: the result does not depend on
  scheduling), divided by rs * norm: m's gradient, 0 where rs * norm is 0.

Elsewhere (CPU, Metal) adapted_linear computes the same in MLX ops; tests compare the
two on a GPU (tests/test_adapted_linear.py) and run these sources on the CPU through a
simulator (tests/test_kernels_simulated.py).
"""

from __future__ import annotations

import mlx.core as mx

from ..cuda import kernel as _kernel, on_cuda  # noqa: F401 (on_cuda: adapted_linear asks here)

_THREADS = 512  # a block (up to 128 registers a thread); the forward kernel past rank 32: 256
_COLUMNS = 16  # output columns a block owns, a multiple of 4

# Over the block's tokens x C columns (both kernels): CPR threads a token row, V2 adjacent
# columns each (a 4-byte access for 2-byte types where aligned), RL rows at a time.
_STRIP = """
    constexpr int CPR = C / V2;
    constexpr int RL = NT / CPR;
    struct alignas(sizeof(T) * V2) Pair { T v[V2]; };
    int tid = threadIdx.x;
    int cp = tid % CPR;
    int rl = tid / CPR;
"""


def _token_pass(first: str, second: str, out: str, width: str, setup: str, combine: str) -> str:
    """C++ for the pass both kernels make over their block's columns and every token row:
    at each row the V2 adjacent values of `first` and `second` as floats x and z, and `out`'s
    from `combine` (statements setting float o for column v) after `setup` (run once, for a
    thread whose columns are inside `width`); 4-byte accesses where all three arrays align."""
    return f"""
    int c = blockIdx.x * C + cp * V2;
    bool al = V2 > 1 && (reinterpret_cast<unsigned long long>({first}) % sizeof(Pair) == 0)
        && (reinterpret_cast<unsigned long long>({second}) % sizeof(Pair) == 0)
        && (reinterpret_cast<unsigned long long>({out}) % sizeof(Pair) == 0);
    if (c < {width}) {{  // {width} is a multiple of V2
        {setup}
        #pragma unroll 8
        for (int t = rl; t < ROWS; t += RL) {{
            long long off = (long long)t * {width} + c;
            Pair xv, zv, ov;
            if (al) {{
                xv = *reinterpret_cast<const Pair*>({first} + off);
                zv = *reinterpret_cast<const Pair*>({second} + off);
            }} else {{
                #pragma unroll
                for (int v = 0; v < V2; ++v) {{
                    xv.v[v] = {first}[off + v];
                    zv.v[v] = {second}[off + v];
                }}
            }}
            #pragma unroll
            for (int v = 0; v < V2; ++v) {{
                float x = static_cast<float>(xv.v[v]);
                float z = static_cast<float>(zv.v[v]);
                float o;
                {combine}
                ov.v[v] = static_cast<T>(o);
            }}
            if (al) {{
                *reinterpret_cast<Pair*>({out} + off) = ov;
            }} else {{
                #pragma unroll
                for (int v = 0; v < V2; ++v) {out}[off + v] = ov.v[v];
            }}
        }}
    }}
"""

_DORA_FORWARD = _STRIP + """
    // Norms of the block's C rows of W + s (A B)^T: a thread on VW adjacent columns j of all
    // C rows, d = w_ij + sum_k A_jk (s B_ki), squares summed per row, then over the block.
    struct alignas(sizeof(WT) * VW) WVec { WT v[VW]; };
    constexpr int NW = NT / 32;
    __shared__ float cs[C * R];
    __shared__ float part[NW * C];
    __shared__ float rss[C];
    int lane = tid & 31;
    int warp = tid >> 5;
    int i0 = blockIdx.x * C;
    float sc = s[0];
    for (int e = tid; e < C * R; e += NT) {
        int q = e / R;
        cs[e] = i0 + q < OUT ? sc * b[(long long)(e % R) * OUT + i0 + q] : 0.0f;
    }
    __syncthreads();
    bool wal = VW > 1 && reinterpret_cast<unsigned long long>(w) % sizeof(WVec) == 0;
    float sq[C];
    #pragma unroll
    for (int q = 0; q < C; ++q) sq[q] = 0.0f;
    for (int j = tid * VW; j < IN; j += NT * VW) {  // IN is a multiple of VW
        float av[VW][R];
        #pragma unroll
        for (int v = 0; v < VW; ++v)
            #pragma unroll
            for (int k = 0; k < R; ++k) av[v][k] = a[(long long)(j + v) * R + k];
        #pragma unroll
        for (int q0 = 0; q0 < C; q0 += 4) {  // 4 rows' loads in flight, few registers held
            WVec wv[4];
            #pragma unroll
            for (int g = 0; g < 4; ++g) {
                long long off = (long long)(i0 + q0 + g) * IN + j;
                if (i0 + q0 + g >= OUT) {
                    #pragma unroll
                    for (int v = 0; v < VW; ++v) wv[g].v[v] = static_cast<WT>(0.0f);
                } else if (wal) {
                    wv[g] = *reinterpret_cast<const WVec*>(w + off);
                } else {
                    #pragma unroll
                    for (int v = 0; v < VW; ++v) wv[g].v[v] = w[off + v];
                }
            }
            #pragma unroll
            for (int g = 0; g < 4; ++g)
                #pragma unroll
                for (int v = 0; v < VW; ++v) {
                    float d = static_cast<float>(wv[g].v[v]);
                    #pragma unroll
                    for (int k = 0; k < R; ++k) d += av[v][k] * cs[(q0 + g) * R + k];
                    sq[q0 + g] += d * d;
                }
        }
    }
    #pragma unroll
    for (int q = 0; q < C; ++q) {
        for (int off = 16; off > 0; off >>= 1) sq[q] += __shfl_xor_sync(0xffffffff, sq[q], off);
        if (lane == 0) part[warp * C + q] = sq[q];
    }
    __syncthreads();
    if (tid < C) {
        int i = i0 + tid;
        float total = 0.0f;
        for (int k = 0; k < NW; ++k) total += part[k * C + tid];
        float nrm = sqrtf(total);
        T r = static_cast<T>(i < OUT ? m[i] / nrm : 0.0f);
        rss[tid] = static_cast<float>(r);  // y takes rs as saved, in the activations' dtype
        if (i < OUT) {
            norm[i] = nrm;
            rs[i] = r;
        }
    }
    __syncthreads();
    // y = rs * (base + s u) over the block's columns and every token row.
""" + _token_pass("base", "u", "y", "OUT", setup="""float r[V2];
        #pragma unroll
        for (int v = 0; v < V2; ++v) r[v] = rss[cp * V2 + v];""", combine="o = r[v] * (x + sc * z);")

_COTANGENT = _STRIP + """
    // g * rs and sum_t g * y over the block's columns and every token row; the RL row lanes'
    // sums added in a fixed order, divided by rs * norm.
    __shared__ float red[RL * C];
    float acc[V2];
    #pragma unroll
    for (int v = 0; v < V2; ++v) acc[v] = 0.0f;
""" + _token_pass("g", "y", "gz", "COLS", setup="""float r[V2];
        #pragma unroll
        for (int v = 0; v < V2; ++v) r[v] = static_cast<float>(rs[c + v]);""", combine="""acc[v] += x * z;
                o = x * r[v];""") + """
    #pragma unroll
    for (int v = 0; v < V2; ++v) red[rl * C + cp * V2 + v] = acc[v];
    __syncthreads();
    int col = blockIdx.x * C + tid;
    if (tid < C && col < COLS) {
        float total = 0.0f;
        for (int k = 0; k < RL; ++k) total += red[k * C + tid];
        float den = static_cast<float>(rs[col]) * norm[col];
        dm[col] = den == 0.0f ? 0.0f : total / den;
    }
"""

# The largest rank the forward kernel takes (A's values for a thread's columns live in
# registers); adapted_linear computes larger ones in MLX ops.
MAX_RANK = 64


def _pair(dtype: mx.Dtype, cols: int) -> int:
    """Adjacent columns a thread takes in the token x column passes: 4 bytes where they fit."""
    return 2 if dtype.size == 2 and cols % 2 == 0 else 1


def _weight_columns(r: int, inp: int, weight_bytes: int) -> int:
    """Adjacent columns of W a thread takes in the norm pass: up to a 16-byte load a row,
    while A's values for them (columns x r floats, in registers) stay within 32 floats
    (a block of 512 threads may use 128 registers a thread), the input width a multiple."""
    vw = 16 // weight_bytes
    while vw > 1 and (inp % vw or vw * r > 32):
        vw //= 2
    return vw


def dora_forward_cuda(weight: mx.array, a: mx.array, b: mx.array, m: mx.array, scale: float,
                      base: mx.array, u: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(y = rs * (base + scale * u), ||W + s (A B)^T||_row float32, rs = m / that norm) for
    W (out, in), A (in, r), B (r, out), m (out,), and base = x W^T, u = (x A) B (tokens, out)
    of one dtype, which y and rs take."""
    out, inp = weight.shape
    rows = base.shape[0]
    r = a.shape[-1]
    dt = base.dtype
    u = u.astype(dt)  # the kernel reads both as one type (a no-op where they already agree)
    # WT (like RT below) puts an input's dtype in the name MLX caches the compiled kernel by
    # (the inputs' dtypes are not in it): a float32 W must not run a bfloat16 W's kernel.
    k = _kernel("meshtune_dora_forward", ["w", "a", "b", "m", "s", "base", "u"], ["y", "norm", "rs"], _DORA_FORWARD)
    threads = _THREADS if r <= 32 else _THREADS // 2  # r floats of A a column in registers
    y, norm, rs = k(inputs=[weight, a.astype(mx.float32), b.astype(mx.float32), m.astype(mx.float32),
                            mx.array([scale], dtype=mx.float32), base, u],
                    template=[("R", r), ("IN", inp), ("OUT", out), ("ROWS", rows), ("C", _COLUMNS),
                              ("NT", threads), ("VW", _weight_columns(r, inp, weight.dtype.size)),
                              ("V2", _pair(dt, out)), ("T", dt), ("WT", weight.dtype)],
                    grid=(-(-out // _COLUMNS) * threads, 1, 1), threadgroup=(threads, 1, 1),
                    output_shapes=[(rows, out), (out,), (out,)], output_dtypes=[dt, mx.float32, dt])
    return y, norm, rs


def cotangent_cuda(g: mx.array, y: mx.array, rs: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y."""
    rows, cols = g.shape
    y = y.astype(g.dtype)  # the kernel reads both as one type (a no-op where they already agree)
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "rs", "norm"], ["gz", "dm"], _COTANGENT)
    gz, dm = k(inputs=[g, y, rs, norm],
               template=[("ROWS", rows), ("COLS", cols), ("C", _COLUMNS), ("NT", _THREADS),
                         ("V2", _pair(g.dtype, cols)), ("T", g.dtype), ("RT", rs.dtype)],
               grid=(-(-cols // _COLUMNS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
               output_shapes=[(rows, cols), (cols,)], output_dtypes=[g.dtype, mx.float32])
    return gz, dm
