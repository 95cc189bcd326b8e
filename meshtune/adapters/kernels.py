"""DoRA's per-layer extra work as CUDA kernels, for MLX's CUDA build.

DoRA adds to each layer's step the norm of the adapted rows (forward) and m's
gradient with the row-scaled cotangent (backward). Each is a few MLX operations, and
the host's dispatch is a large part of a GPU step (scripts/probes/dispatch_cost.py:
~60%), so each gets as few launches as the GPU's time allows:

- `row_norms_cuda` (before the forward): ||W + s (A B)^T||_row in one pass over W:
  each row's adapted elements formed in registers from 16-byte loads of W and A staged
  in shared memory (by float4 loads, several in flight), squared and summed, never
  stored (on the CPU and Metal the MLX ops use DESIGN.md's identity instead, where W A
  is a product already running). It takes
  the place of a skinny matmul, the Gram's matmul and the norm's small operations. The
  norm depends on the parameters only, so a training step takes every layer's at once
  (adapters/step_norms.py): one launch for all the layers of a shape, instead of one
  small launch a layer. For the 1B bench model on an H200 that is 7 launches for 112
  layers, and the bf16 step went from 80.6 to 73.5 ms (LoRA 54.1 ms;
  docs/bench/step_norms_h200.txt).
- `cotangent_cuda` (backward): the row-scaled cotangent g * rs and m's column sums
  sum_t g * y in one pass over g and y, 16-byte accesses, blocks of columns by chunks
  of rows (a block per column strip gave a 1024-wide layer 32 blocks for 132 SMs);
  a second small kernel adds the chunks' sums in a fixed order, so the result does not
  depend on scheduling, and divides by rs * norm.

- Folded (FOLD_ROW_SCALE, on by default): `row_norms_and_scaled_cuda` also writes W' = rs W after
  each row's norm (the row read again from the L2 cache); the layers run LoRA's product on W'
  and B' = B rs (adapted_linear's `folded`), and `magnitude_grad_cuda` takes m's gradient
  from g and y alone (the cotangent kernel without its g * rs write). A launch's outputs are one
  array a kind for all its layers, split into views (not an output a layer: ~100 outputs each
  carrying ~130 inputs cost the host ~4x as much; docs/bench/dora_stacked_h200.txt). The launches
  write A and B' in W's dtype too (_WRITE_FACTORS, on), sparing the layers' 224 casts: +0.3 ms of
  host time for the launches against ~0.9 ms for the casts; the 1B step's change was inside the
  drift between rounds on an H200 (docs/bench/dora_factors_h200.txt).
- Packed (PackedWeight): on an affine 2/4/8-bit base the folded launch reads the packed weight and
  dequantizes W's rows as it reads them (bit-equal to mx.dequantize), so no layer dequantizes a copy
  first; on an H200 it costs about the dense launch and spares the 112 dequantizes of the 1B step
  (docs/bench/dora_packed_h200.txt). m's gradient kernel reads a layer's norms in the launch's array
  (StackedNorm) and forms B's gradient (s p) rs in the same launch: no per-layer views or multiplies.
- B's product in the sums' pass (B_PRODUCT_IN_SUMS, on): `magnitude_and_b_grad_cuda` sums (x A)^T g by chunks
  in the column sums' pass over g, so the folded backward has no matmul for B's gradient (a cuBLAS launch
  a layer, which MLX's CUDA build records by stream capture) and reads g once; with the launches' A and B'
  (no casts) a DoRA layer's step has as many launches as a LoRA layer's (graph_nodes.py --cuda: 4725 nodes
  a step against LoRA's 4729; 4943 before).
- Resident A (_RESIDENT_A, on): where a row fits one block's threads, the folded launch keeps each
  thread's rows of A in registers and writes W' from the row it read (W read once, A once a block).
- Two passes (_TWO_PASS, off): the norms by segments of columns, a thread a row, then W' a
  warp a row; as fast as the one pass on an H200 (docs/bench/dora_two_pass_h200.txt).

The forward's rs * (base + s u) is left to MLX's fused elementwise kernel (a kernel of
ours for it lost in the 1B step on an H200: 77.2 vs 75.1 ms, docs/bench/step_norms_h200.txt).

Elsewhere (CPU, Metal) adapted_linear computes the same in MLX ops; tests compare the
two on a GPU (tests/test_adapted_linear.py).
"""

from __future__ import annotations

import os
import textwrap
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..runtime.cuda import kernel as _kernel, kernel_constant, on_cuda  # noqa: F401 (on_cuda: adapted_linear asks here)
from ..runtime.env import choice

_WARPS = 8  # warps a block
_ROWS_PER_WARP: int | None = None  # rows of W a warp takes; None: 2 up to rank 16, else 1
# Groups of _WARPS x rows-a-warp rows a block takes, each staged tile of A serving them all.
# With 1, A is staged once per 16 rows: as many bytes of A through shared memory as of W.
# In the 1B step on an H200, 4 and 8 groups were within the host's drift of 1 (faster by
# 2.0 ms in one invocation, slower by 2.3 ms in the next: docs/bench/dora_step_parts_h200.txt).
# For the folded kernel (norms and W') no swept layout beat 8 warps x 2 rows x 1 group, and 2-8
# groups took 2-3x as long (docs/bench/dora_folded_h200.txt).
_ROW_GROUPS = 1
# Floats of A a shared tile holds (None: 8192 up to rank 32, else 4096). ptxas (CUDA 13, sm_90) gives
# the 1B model's bf16 rank-8 kernels 141 registers a thread at 8192 (1024 rows of A): one block of 8
# warps fits an SM's registers. At 2048 (256 rows) they take 127, two blocks; the columns each lane
# sums, and their order, are the same either way. On one H200 (docs/bench/dora_two_pass_h200.txt) 256-row tiles took
# the 1B step's norms and W' from 4.36 to 4.01 ms on one machine (the norms alone from 2.14 to 2.40), and with 4
# loads in flight from 2.53 to 2.66 on another; the step gained nothing measurable (probe_dora_step): the default stays.
_TILE_FLOATS: int | None = None
# A's tiles staged by float4 loads, four a thread in flight (False: a float at a time, as before;
# scripts/probes/dora_kernel_cost.py times both).
_STAGE_QUADS = True

# W's loads, for the kernels that read it (w, WVec and VEC in scope): VEC elements of row `row` from column
# `col` (a multiple of VEC), one 16-byte load where W is aligned.
_READ_W = """    bool aligned = VEC > 1 && reinterpret_cast<unsigned long long>(w) % sizeof(WVec) == 0;
    auto read_w = [&](int row, int col) {
        WVec r;
        long long off = (long long)row * IN + col;
        if (aligned) {
            r = *reinterpret_cast<const WVec*>(w + off);
        } else {
            #pragma unroll
            for (int v = 0; v < VEC; ++v) r.v[v] = w[off + v];
        }
        return r;
    };
"""

# Every row-norm kernel's layer, after its own declarations: the layer's arrays (@SELECT@, by blockIdx.y), its
# scale s, its rows of the launch's outputs and W's loads (read_w).
_LAYER_ARRAYS = """    const WT* w;
    const float* a;
    const float* b;
    @SELECT@
    float sc = s[blockIdx.y];
@LAYER_OUTPUTS@
@READ_W@"""

_ROW_NORM = """
    // Block: G groups of WARPS warps, RPW adjacent rows of W each, of layer blockIdx.y: the
    // launch takes L layers of one shape, a switch (written by row_norms_cuda) points w, a and b at
    // that layer's arrays, and its norms are rows blockIdx.y * OUT onward of the launch's one array.
    // The norm is taken row by row without storing the adapted row: element j is d_j = w_ij + s sum_k A_jk B_ki, and the lanes
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
@LAYER_ARRAYS@
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
                if (row0 + q >= OUT || c >= n) {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) wr[p][q].v[v] = static_cast<WT>(0.0f);
                } else {
                    wr[p][q] = read_w(row0 + q, j0 + c);
                }
            }
        }
    };
    // s * B's column for each of the warp's rows, loaded once (not again for every tile of A).
    float cb[G][RPW][R];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int q = 0; q < RPW; ++q)
            #pragma unroll
            for (int k = 0; k < R; ++k) {
                int i = first_row(g) + q;
                cb[g][q][k] = i < OUT ? sc * b[k * OUT + i] : 0.0f;
            }
    // A's tile is n * R consecutive floats. SQ: staged by float4 loads, four of them a thread in
    // flight before their stores (a round trip to the L2 cache per four, not one per float).
    bool a_quads = SQ && reinterpret_cast<unsigned long long>(a) % 16 == 0;
    for (int j0 = 0; j0 < IN; j0 += TJ) {
        int n = min(TJ, IN - j0);  // a multiple of VEC (IN and TJ are)
        load_w(first_row(0), j0, n);  // the first group's loads in flight while A is staged
        int staged = 0;
        if (a_quads) {  // j0 * R floats from a 16-byte boundary: j0 is a multiple of 32
            const float4* a4 = reinterpret_cast<const float4*>(a + (long long)j0 * R);
            int quads = n * R / 4;
            for (int base = 0; base < quads; base += 4 * NT) {
                float4 q4[4];
                #pragma unroll
                for (int h = 0; h < 4; ++h) {
                    int e4 = base + h * NT + tid;
                    if (e4 < quads) q4[h] = a4[e4];
                }
                #pragma unroll
                for (int h = 0; h < 4; ++h) {
                    int e = (base + h * NT + tid) * 4;
                    if (e < quads * 4) {
                        sa[(e % R) * SA + e / R] = q4[h].x;
                        sa[((e + 1) % R) * SA + (e + 1) / R] = q4[h].y;
                        sa[((e + 2) % R) * SA + (e + 2) / R] = q4[h].z;
                        sa[((e + 3) % R) * SA + (e + 3) / R] = q4[h].w;
                    }
                }
            }
            staged = quads * 4;
        }
        for (int e = staged + tid; e < n * R; e += NT) sa[(e % R) * SA + e / R] = a[(long long)j0 * R + e];
        __syncthreads();
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            int row0 = first_row(g);
            if (g > 0) load_w(row0, j0, n);
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
                            for (int v = 0; v < VEC; ++v) t[q][v] += av[v] * cb[g][q][k];
                    }
@STORE_ADAPTED@                    #pragma unroll
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

# W's loads where the base is affine-quantized (PackedWeight): the row dequantized as it is read, so a step's
# folded launch reads the packed weight (a quarter of bf16's bytes at 4 bits) and no layer dequantizes a copy
# first. VEC = 32 / QB elements are one 32-bit word, all in one group of GS (a multiple of VEC); each is
# q * scale + bias in float32, rounded once to WT, as MLX's CUDA dequantize gives it (rounding after the multiply
# too was off by an ulp of bfloat16 here and there on an H200: scripts/probes/packed_norms.py).
_READ_PACKED_W = """    bool aligned = true;  // a lane's VEC elements come from one word; W' is written by 16-byte stores
    auto read_w = [&](int row, int col) {
        WVec r;
        long long e = (long long)row * IN + col;
        unsigned word = w[e / VEC];
        float sc = static_cast<float>(qs[e / GS]);
        float bi = static_cast<float>(qb[e / GS]);
        #pragma unroll
        for (int v = 0; v < VEC; ++v) {
            float q = static_cast<float>((word >> (v * QB)) & ((1u << QB) - 1u));
            r.v[v] = static_cast<WT>(q * sc + bi);
        }
        return r;
    };
"""
# A packed weight's arrays where a dense one has w (the packed words, their scales and biases).
_PACKED_DECLS = "    const unsigned* w;\n    const WT* qs;\n    const WT* qb;\n"


class PackedWeight(NamedTuple):
    """An affine-quantized base weight as the folded norm launch reads it: (out, in * bits / 32) uint32 words,
    (out, in / group_size) scales and biases in the dtype it dequantizes to."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype


# Bit widths whose elements tile a 32-bit word (the 3-, 5- and 6-bit packings straddle words).
PACKED_BITS = (2, 4, 8)


def packed_weight(layer) -> PackedWeight | None:
    """`layer`'s weight as the folded launch reads it packed (nn.QuantizedLinear, affine, PACKED_BITS, float scales),
    or None: the caller then hands the launch a dequantized copy (so too where reads_packed() says no)."""
    if (not isinstance(layer, nn.QuantizedLinear) or layer.mode != "affine"
            or layer.bits not in PACKED_BITS or "biases" not in layer or _TWO_PASS
            or not mx.issubdtype(layer.scales.dtype, mx.floating) or layer.group_size % (32 // layer.bits)):
        return None
    return PackedWeight(layer.weight, layer.scales, layer["biases"], layer.bits, layer.group_size)


def reads_packed(weight: PackedWeight, r: int) -> bool:
    """Whether the folded launch's layout for rank r takes one word of `weight` a lane (VEC = 32 / bits)."""
    return _packed_layout(r, weight) is not None


def _packed_layout(r: int, weight: PackedWeight) -> tuple[int, int, int] | None:
    """_row_scale_layout's (rows a warp, columns a lane, tile rows) with a word a lane, or None where a tile of A
    would hold fewer than a warp's columns."""
    vec = 32 // weight.bits
    rows = _ROWS_PER_WARP or (2 if r <= 16 else 1)
    floats = _TILE_FLOATS or _default_tile_floats(r)
    if weight.shape[1] % vec or floats // r < 32 * vec:
        return None
    return rows, vec, floats // r // (32 * vec) * (32 * vec)

_COTANGENT = """
    // Block: 8 warps on 32 * VEC columns, a thread on VEC consecutive columns (one 16-byte
    // access where aligned), the warps striding over the block's chunk of rows. Each
    // block's column sums go to its row of `part`, added in a fixed order.
    RS_FROM_M
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
        && (reinterpret_cast<unsigned long long>(y) % sizeof(Vec) == 0)@GZ_ALIGNED@;
    float acc[VEC];
    @ROW_SCALES@
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    if (c0 < COLS) {  // COLS is a multiple of VEC: a thread's columns are all in or all out
        for (int t = t0 + warp; t < t1; t += 8) {
            long long off = (long long)t * COLS + c0;
            Vec gv, yv;
            if (aligned) {
                gv = *reinterpret_cast<const Vec*>(g + off);
                yv = *reinterpret_cast<const Vec*>(y + off);
            } else {
                for (int v = 0; v < VEC; ++v) {
                    gv.v[v] = g[off + v];
                    yv.v[v] = y[off + v];
                }
            }
            @ELEMENT@
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

# m's gradient from the chunks' column sums (the second launch; below, how a block adds them). The layer's
# norms are entries off[0] onward of `norms` (a launch's stacked norms, StackedNorm; 0 for an array of
# its own), so a training step hands each layer no view of its own. @B_GRAD@: with B's gradient in the
# folded product, d B = s (x A)^T g rs from the product p = (x A)^T g in GT: s p rounded to GT as MLX's
# multiply by s rounds it (s first rounded to GT, as MLX casts a Python scalar), then times rs, formed here.
# A block takes 32 columns: its _SUM_WARPS warps sum every _SUM_WARPS-th chunk of them (warp j chunks j,
# j + 8, ...: a warp's reads are 32 adjacent floats), then each column adds the warps' sums in warp order, so
# the order is fixed. One thread a column summing every chunk in turn left 4-24 blocks on the GPU doing 22-128
# dependent reads each (docs/bench/magnitude_sums_h200.txt: 2.23 -> 2.10 ms with the column sums, 112 layers).
# A warp's chunks are loaded before any is added (PER_WARP registers: 16 at 128 chunks).
_SUM_WARPS = 8
_MAGNITUDE_GRAD = """
    const float* norm = norms + off[0];
    RS_FROM_M
    __shared__ float sums[WARPS][32];
    int c = threadIdx.x & 31, j = threadIdx.x >> 5;
    int col = blockIdx.x * 32 + c;
    // Every chunk's load issued before the first add (then m's and the norm's): read one after another,
    // each waiting on the add before it, they took ~10 us a layer on an H200 (ncu), for ~0.5 MB read.
    constexpr int PER_WARP = (CHUNKS + WARPS - 1) / WARPS;
    float got[PER_WARP];
    #pragma unroll
    for (int q = 0; q < PER_WARP; ++q)
        got[q] = col < COLS && j + q * WARPS < CHUNKS ? part[(long long)(j + q * WARPS) * COLS + col] : 0.0f;
    float rs = col < COLS ? row_scale(col) : 0.0f;
    float sum = 0.0f;
    #pragma unroll
    for (int q = 0; q < PER_WARP; ++q)
        if (j + q * WARPS < CHUNKS) sum += got[q];  // chunks j, j + WARPS, ... in turn, as before
    sums[j][c] = sum;
    __syncthreads();
    if (col < COLS) {
        if (j == 0) {
            float total = 0.0f;
            for (int i = 0; i < WARPS; ++i) total += sums[i][c];
            float den = rs * norm[col];
            dm[col] = den == 0.0f ? 0.0f : total / den;
        }@B_GRAD@
    }
"""
_B_GRAD = """
        float sc = static_cast<float>(static_cast<GT>(bscale[0]));
        for (int k = j; k < R; k += WARPS) {  // B's rows shared out over the warps
            long long e = (long long)k * COLS + col;
            gbo[e] = static_cast<float>(static_cast<GT>(sc * static_cast<float>(gb[e]))) * rs;
        }"""

# DoRA's row scale rs = m / norm, rounded to the activations' dtype T as the MLX ops round it,
# computed where it is used (no launch of its own, no rs array).
_RS_FROM_M = "auto row_scale = [&](int c) { return static_cast<float>(static_cast<T>(m[c] / norm[c])); };"
# The cotangent kernel writes g * rs beside the column sums; the sums-only kernel
# (magnitude_grad_cuda, for a product folded into W' and B', row_norms_and_scaled_cuda) does not.
_SCALED_COTANGENT = {
    "@GZ_ALIGNED@": "\n        && (reinterpret_cast<unsigned long long>(gz) % sizeof(Vec) == 0)",
    "@ROW_SCALES@": "float r[VEC];\n    for (int v = 0; v < VEC; ++v) r[v] = c0 + v < COLS ? row_scale(c0 + v) : 0.0f;",
    "@ELEMENT@": """Vec out;
            for (int v = 0; v < VEC; ++v) {
                float gf = static_cast<float>(gv.v[v]);
                acc[v] += gf * static_cast<float>(yv.v[v]);
                out.v[v] = static_cast<T>(gf * r[v]);
            }
            if (aligned) {
                *reinterpret_cast<Vec*>(gz + off) = out;
            } else {
                for (int v = 0; v < VEC; ++v) gz[off + v] = out.v[v];
            }""",
}
_SUMS_ONLY = {
    "@GZ_ALIGNED@": "",
    "@ROW_SCALES@": "",
    "@ELEMENT@": """for (int v = 0; v < VEC; ++v)
                acc[v] += static_cast<float>(gv.v[v]) * static_cast<float>(yv.v[v]);""",
}


# B's product in the sums' pass (B_PRODUCT_IN_SUMS, on): the folded backward's d B = s (x A)^T g rs took a cuBLAS
# matmul a layer, (r x tokens) by (tokens x out), a second pass over g beside the column sums' pass, and a graph
# node the host dispatches by stream capture. Here the column sums' blocks (the template above) also sum u_tk g_ti
# for B's R rows (u = x A, each row's R values read once by a warp), by chunks of rows, and write them to `bpart`
# after the column sums, a row of B at a time through the same shared buffer; a second kernel adds the chunks in a
# fixed order for m's gradient and B's, p rounded to the activations' dtype as the matmul's output is, then (s p) rs
# as _B_GRAD forms it. A thread keeps R x VEC sums (VEC columns, at most _B_SUMS_FLOATS floats), so VEC shrinks as
# the rank grows; blocks aim at _B_SUMS_BLOCKS, fewer than the column sums' alone, so the second kernel adds
# fewer chunks (each thread adds a row of B's chunks in turn).
B_PRODUCT_IN_SUMS = True
_B_SUMS_BLOCKS = 264
_B_SUMS_FLOATS = 64
_B_SUMS = {
    "@GZ_ALIGNED@": "",
    "@ROW_SCALES@": """float bacc[R][VEC];
    #pragma unroll
    for (int k = 0; k < R; ++k)
        #pragma unroll
        for (int v = 0; v < VEC; ++v) bacc[k][v] = 0.0f;""",
    "@ELEMENT@": """float uk[R];
            #pragma unroll
            for (int k = 0; k < R; ++k) uk[k] = static_cast<float>(u[(long long)t * R + k]);
            #pragma unroll
            for (int v = 0; v < VEC; ++v) {
                float gf = static_cast<float>(gv.v[v]);
                acc[v] += gf * static_cast<float>(yv.v[v]);
                #pragma unroll
                for (int k = 0; k < R; ++k) bacc[k][v] += uk[k] * gf;
            }""",
}
_B_ROWS = """
    #pragma unroll
    for (int k = 0; k < R; ++k) {
        __syncthreads();  // the shared sums' last reads are done
        #pragma unroll
        for (int v = 0; v < VEC; ++v) sums[warp][lane * VEC + v] = bacc[k][v];
        __syncthreads();
        for (int c = tid; c < CB; c += 256) {
            int col = blockIdx.x * CB + c;
            if (col < COLS) {
                float total = 0.0f;
                for (int w = 0; w < 8; ++w) total += sums[w][c];
                bpart[((long long)blockIdx.y * R + k) * COLS + col] = total;
            }
        }
    }
"""
# The second kernel's B part: B's rows shared out over the warps (warp j rows j, j + WARPS, ...), each thread adding
# its row's chunks in order, LOADS at a time loaded before they are added; p = that sum rounded to GT, d B = (s p
# rounded to GT) rs.
_B_FROM_SUMS = """
        float sc = static_cast<float>(static_cast<GT>(bscale[0]));
        constexpr int LOADS = 16;
        for (int k = j; k < R; k += WARPS) {
            float p = 0.0f;
            for (int q0 = 0; q0 < CHUNKS; q0 += LOADS) {
                float got_b[LOADS];
                #pragma unroll
                for (int q = 0; q < LOADS; ++q)
                    got_b[q] = q0 + q < CHUNKS ? bpart[((long long)(q0 + q) * R + k) * COLS + col] : 0.0f;
                #pragma unroll
                for (int q = 0; q < LOADS; ++q)
                    if (q0 + q < CHUNKS) p += got_b[q];
            }
            float pr = static_cast<float>(static_cast<GT>(p));
            gbo[(long long)k * COLS + col] = static_cast<float>(static_cast<GT>(sc * pr)) * rs;
        }"""


def _fill(source: str, parts: dict[str, str]) -> str:
    for key, text in parts.items():
        assert key in source, key  # a template's placeholder renamed would otherwise leave a kernel unchanged
        source = source.replace(key, text)
    return source


_COLUMN_SUMS = _fill(_COTANGENT.replace("RS_FROM_M", ""), _SUMS_ONLY)
_COLUMN_AND_B_SUMS = _fill(_COTANGENT.replace("RS_FROM_M", ""), _B_SUMS) + _B_ROWS
_COTANGENT = _fill(_COTANGENT.replace("RS_FROM_M", _RS_FROM_M), _SCALED_COTANGENT)
_MAGNITUDE_PARTS = {"RS_FROM_M": _RS_FROM_M, "WARPS": str(_SUM_WARPS)}
_MAGNITUDE_AND_B_GRAD = _fill(_MAGNITUDE_GRAD.replace("@B_GRAD@", _B_GRAD), _MAGNITUDE_PARTS)
_MAGNITUDE_AND_B_SUMS = _fill(_MAGNITUDE_GRAD.replace("@B_GRAD@", _B_FROM_SUMS), _MAGNITUDE_PARTS)
_MAGNITUDE_GRAD = _fill(_MAGNITUDE_GRAD.replace("@B_GRAD@", ""), _MAGNITUDE_PARTS)

# Cotangent blocks to aim for: ~4 per SM of an H200 (132 SMs), a chunk at least 32 rows.
_COTANGENT_BLOCKS = 528


# Whether a training step folds DoRA's row scale into the weights (step_norms.py writes W' = rs W
# beside the norms; adapted_linear's folded product): LoRA's product on W' and B', m's gradient
# the only pass DoRA adds. On one H200 the 1B bf16 DoRA step went from 48.1 to 45.7 ms, 4-bit from
# 49.5 to 48.1 (docs/bench/adapters_h200_overlapped.txt, adapters_h200_fold.txt). On a quantized
# base W' takes the place of the dequantized copy; on a dense base it is a copy held through the
# step, so "auto" (the default) folds those only while their copies take at most FOLD_MEMORY_SHARE
# of the GPU's memory. MESHTUNE_DORA_FOLD=1 folds always, 0 never (the row scale then rides on the
# fused sum and the cotangent kernel).
FOLD_ENV = "MESHTUNE_DORA_FOLD"
FOLD_SETTINGS = {"auto": "auto", "1": True, "0": False}
FOLD_MEMORY_SHARE = 0.125


def _fold_setting(value: str) -> bool | str:
    return choice(FOLD_ENV, value, FOLD_SETTINGS, "auto (the default: fold DoRA's row scale into the weights while a "
                  "dense base's folded copies fit in 1/8 of the GPU's memory), 1 (always) or 0 (never)")


FOLD_ROW_SCALE = _fold_setting(os.environ.get(FOLD_ENV, "auto"))
# MERGED_FOLD: for a layer whose branch takes x itself (no dropout), the folded launch writes the whole adapted
# weight, W' = rs (W + s (A B)^T), not rs W: each adapted element is what the launch squares for the norm, so it is
# there already. The layer's forward is then one product, x W'^T, and its input's gradient one, g W': LoRA's two
# branch products, their sum and the addmm's second product go (four graph nodes a layer, ~450 a step for the 1B
# model), and with them their GPU passes over the activations. B's and A's gradients and m's are as before.
MERGED_FOLD = True

# The largest rank the row-scale kernel takes (its accumulators live in registers);
# adapted_linear computes larger ones in MLX ops.
MAX_RANK = 64


def _default_tile_floats(r: int) -> int:
    """Floats of A a shared tile holds: about 32 KiB (16 KiB past rank 32), under a block's 48 KiB of static shared memory."""
    return 8192 if r <= 32 else 4096


# Rows of A a shared tile holds in the folded launch's staged layout (where they are fewer than the default
# tile's): 127 registers a thread, two blocks an SM, not 141 and one (scripts/probes/kernel_registers.py). On an
# H200 the staged folded launch took 1.080 -> 0.985 ms for the 1B model's 16 down projections (2048 x 6144), and
# 0.85-0.93x the time on its other shapes, layouts interleaved, one invocation (docs/bench/adapters_h200_22.txt,
# block 1: "staged, tiles 256" against "staged"); the norms-only
# kernel stays on the default tile (2.14 -> 2.40 ms with 256 rows, docs/bench/dora_two_pass_h200.txt).
FOLDED_TILE_ROWS = 256


def _row_scale_layout(r: int, inp: int, weight_bytes: int, folded: bool = False) -> tuple[int, int, int]:
    """(rows of W a warp takes, columns a lane loads at once, rows of A a shared tile holds).

    Rows a warp: each value of A read from shared memory serves them all, but they hold r
    registers each and fewer rows a block means more blocks for narrow layers. Columns:
    one 16-byte load of W where the input width allows. Tile: about 32 KiB of float32
    (16 KiB past r = 32), under the 48 KiB a block may hold statically, a multiple of a
    warp's columns; `folded` (the launch writing W'): FOLDED_TILE_ROWS rows where that is less.
    """
    rows = _ROWS_PER_WARP or (2 if r <= 16 else 1)
    floats = _TILE_FLOATS or _default_tile_floats(r)
    if folded and not _TILE_FLOATS and FOLDED_TILE_ROWS >= 32 * (16 // weight_bytes):  # a warp's 16-byte loads
        floats = min(floats, FOLDED_TILE_ROWS * r)
    vec = 16 // weight_bytes
    while vec > 1 and (inp % vec or floats // r < 32 * vec):
        vec //= 2
    return rows, vec, max(32 * vec, floats // r // (32 * vec) * (32 * vec))


# Layers one row-norm launch takes at most (each adds four pointers to the kernel's parameters).
MAX_LAYERS_A_LAUNCH = 32


# After the norms, the scaled-weight kernel (row_norms_and_scaled_cuda) writes W' = rs W: a
# warp, holding each of its rows' norms in every lane (the butterfly's sum), reads the row again
# (from the L2 cache, just read) and writes rs * w, rs = m / norm rounded to W's dtype as the MLX
# ops round it. _SCALED_LOADS: loads of the row a lane has in flight before it stores (1: a load,
# then its store). By the bytes they move the norm-and-W' kernels ran at ~1.1 TB/s on an H200
# (docs/bench/dora_folded_h200.txt). On one H200 2, 4 and 8 loads took 5.25, 4.37 and 4.33 ms for the 1B
# step's norms and W' against 4.36 with 1, in one invocation (docs/bench/dora_two_pass_h200.txt): no gain.
_SCALED_LOADS = 1
# Row i of W' = rs W written by a warp's lanes (read_w, ws_aligned, row = i * IN in scope), EB loads of the row
# in flight before their stores (ws may alias w for all the compiler knows, so it would not hoist a load above an
# earlier store itself): the one-pass kernel's epilogue and the two-pass kernel's pass 2.
_WRITE_SCALED_ROW = """for (int c0 = lane * VEC; c0 < IN; c0 += 32 * VEC * EB) {
    WVec in[EB];
    #pragma unroll
    for (int u = 0; u < EB; ++u) {
        int c = c0 + u * 32 * VEC;
        if (c < IN) in[u] = @READ_ROW@(i, c);  // not break: a loop with no early exit unrolls fully
    }
    #pragma unroll
    for (int u = 0; u < EB; ++u) {
        int c = c0 + u * 32 * VEC;
        if (c >= IN) continue;
        WVec out;
        #pragma unroll
        for (int v = 0; v < VEC; ++v) out.v[v] = static_cast<WT>(rs * static_cast<float>(in[u].v[v]));
        if (ws_aligned) {
            *reinterpret_cast<WVec*>(ws + row + c) = out;
        } else {
            #pragma unroll
            for (int v = 0; v < VEC; ++v) ws[row + c + v] = out.v[v];
        }
    }
}
"""
_SCALED_DECLS = "    const float* mm;\n"
# kernels.MERGED_FOLD in the staged kernel: each adapted element d = w + s sum_k A B, formed in the tile loop for the
# norm (A's tile in shared memory), is stored in W' there (rounded to W's dtype: with the epilogue's rounding of
# rs d, two roundings); the epilogue reads the row back from W' (this lane's own stores, from the L2 cache) in
# place of W and writes rs d. Forming d again in the epilogue, A read from the L2 cache a row at a time, took the
# 1B model's 16 down projections 7.24 ms against 1.18 unmerged on an H200 (folded_launch_shapes.py --merged).
_STORE_ADAPTED = """                    if (MERGED) {  // d stored in W' for the epilogue to scale
                        bool ws_vec = reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0;
                        #pragma unroll
                        for (int q = 0; q < RPW; ++q) {
                            if (row0 + q >= OUT) continue;
                            WVec d;
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) d.v[v] = static_cast<WT>(t[q][v]);
                            long long off = (long long)(row0 + q) * IN + j0 + c;
                            if (ws_vec) {
                                *reinterpret_cast<WVec*>(ws + off) = d;
                            } else {
                                #pragma unroll
                                for (int v = 0; v < VEC; ++v) ws[off + v] = d.v[v];
                            }
                        }
                    }
"""
# The epilogue's reads of row i (VEC elements from column c): W, or where MERGED the adapted row stored in W'.
_READ_ROW = """
    auto read_row = [&](int i, int c) {
        if (!MERGED) return read_w(i, c);
        WVec r;
        long long off = (long long)i * IN + c;
        if (reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0) {
            r = *reinterpret_cast<const WVec*>(ws + off);
        } else {
            #pragma unroll
            for (int v = 0; v < VEC; ++v) r.v[v] = ws[off + v];
        }
        return r;
    };"""
_SCALED_EPILOGUE = """
    bool ws_aligned = aligned && reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0;@READ_ROW@
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int q = 0; q < RPW; ++q) {
            int i = first_row(g) + q;
            if (i >= OUT) continue;
            float rs = static_cast<float>(static_cast<WT>(mm[i] / sqrtf(sq[g][q])));
            if (lane == q) rso[i] = rs;
@WRITE_B@            long long row = (long long)i * IN;
@WRITE_SCALED_ROW@
        }
""".replace("@WRITE_SCALED_ROW@", textwrap.indent(_WRITE_SCALED_ROW.replace("@READ_ROW@", "read_row"), " " * 12)).replace(
    "@READ_ROW@", _READ_ROW)


def _select(layers: int, assign: str) -> str:
    """A switch on blockIdx.y running `assign` (formatted with i) for that layer; other y return."""
    cases = "\n".join(f"        case {i}: {assign.format(i=i)} break;" for i in range(layers))
    return f"switch (blockIdx.y) {{\n{cases}\n        default: return;\n    }}"


# A launch's outputs are one array of each kind for all its layers (_per_layer splits them): a layer's rows
# start at blockIdx.y * OUT. With an output of its own a layer, each of a launch's ~100 outputs carried all its
# ~130 inputs (MLX gives every output of a primitive its own list of the inputs): on an H200 the 1B step's 4
# launches took 2.3 ms to build and 2.4 ms to dispatch with W'; stacked, 0.8 and 0.5 ms on the next machine
# (scripts/probes/kernel_dispatch.py; docs/bench/dora_stacked_h200.txt). On the CPU a stand-in with the same
# inputs and outputs, compiled, took 0.9 and 0.9 ms against 0.2 and 0.5 (scripts/probes/stacked_outputs.py).
_NORM_OUTPUT = "    float* norm = norms + (long long)blockIdx.y * OUT;"
# _WRITE_FACTORS: the layers' A and B' = B rs in W's dtype, written by the folded kernel beside W' (one array
# each for a launch's layers), in place of every layer's two casts (224 graph nodes a step for the 1B model:
# adapted_linear's `factors`). Written with an output a layer (18badf4) they made the launches dearer, 3.37 vs
# 1.60 ms to build and 6.09 vs 4.64 to run on an H200 (docs/bench/dora_kernel_casts_h200.txt): the per-output
# cost the stacked outputs removed. Stacked, the launches' host time grows by ~0.3 ms a step and the casts' ~0.9 ms
# goes; the 1B step on an H200 moved inside its drift (1.216x -> 1.119x LoRA's in one invocation, 1.165x -> 1.182x
# in the next; docs/bench/dora_factors_h200.txt). On, for the host arithmetic.
_WRITE_FACTORS = True
_FACTOR_OUTPUTS = ("    WT* aso = ass + (long long)blockIdx.y * IN * R;\n"
                   "    WT* bso = bss + (long long)blockIdx.y * R * OUT;")
# B' = B rs for row i (B is (R, OUT): column i), by the warp's lanes; then the layer's A in W's dtype, the
# layer's blocks striding over it.
_WRITE_B = """            for (int k = @THREAD@; k < R; k += @THREADS@)
                bso[(long long)k * OUT + i] = static_cast<WT>(b[(long long)k * OUT + i] * rs);
"""
_WRITE_A = """
    for (long long e = (long long)blockIdx.x * NT + tid; e < (long long)IN * R; e += (long long)gridDim.x * NT)
        aso[e] = static_cast<WT>(a[e]);
"""
_SCALED_OUTPUTS = ("    WT* ws = wss + (long long)blockIdx.y * OUT * IN;\n"
                   "    float* rso = rss + (long long)blockIdx.y * OUT;")


def _row_norm_source(layers: int, scaled: bool = False, factors: bool = False, packed: bool = False,
                     resident: bool = False) -> str:
    """The row-norm kernel (the staged one, or with `resident` the folded one holding A in registers) with its
    @SELECT@ pointing w, a and b (and with `scaled`, m; where `packed`, the quantized weight's scales and biases)
    at layer blockIdx.y's arrays, and the norms (and W' and rs; with `factors`, A and B' too) at its rows of the
    launch's outputs."""
    if resident and not scaled:
        raise ValueError("_row_norm_source: the resident layout is the folded launch's (scaled) only")
    extra = (" mm = m{i};" if scaled else "") + (" qs = qs{i}; qb = qb{i};" if packed else "")
    body = _ROW_NORM_RESIDENT if resident else _ROW_NORM
    source = body.replace("@LAYER_ARRAYS@", _LAYER_ARRAYS).replace(
        "@SELECT@", _select(layers, "w = w{i}; a = a{i}; b = b{i};" + extra))
    if packed:
        source = source.replace("    const WT* w;\n", _PACKED_DECLS, 1)
    outputs = [_NORM_OUTPUT] + ([_SCALED_OUTPUTS] if scaled else []) + ([_FACTOR_OUTPUTS] if factors else [])
    source = source.replace("@STORE_ADAPTED@", _STORE_ADAPTED if scaled else "")
    source = source.replace("@LAYER_OUTPUTS@", "\n".join(outputs)).replace(
        "@READ_W@", _READ_PACKED_W if packed else _READ_W)
    if scaled:
        # B' = B rs for row i by the threads that share the row: a warp's lanes (staged) or the block's (resident).
        thread, threads = ("tid", "NT") if resident else ("lane", "32")
        write_b = _WRITE_B.replace("@THREAD@", thread).replace("@THREADS@", threads) if factors else ""
        source = source.replace("    const float* b;\n", "    const float* b;\n" + _SCALED_DECLS, 1)
        # The resident kernel writes W' (and B') as it goes; the staged one after its norms (the epilogue).
        source = (source.replace("@WRITE_B@", write_b) if resident
                  else source + _SCALED_EPILOGUE.replace("@WRITE_B@", write_b))
    return source + (_WRITE_A if factors else "")


# The folded launch with A resident (_RESIDENT_A, on): a thread takes VEC consecutive columns of every row
# (IN = VEC x the block's threads) and holds A's rows for those columns in registers, loaded once a block;
# the block takes RESIDENT_ROWS rows of one layer, RESIDENT_BATCH at a time: their loads in flight
# together, each row's adapted elements d_j = w_ij + s sum_k A_jk B_ki squared and summed by the thread,
# the warps' sums added through shared memory (one barrier a batch), and the row written as W' = rs W
# from the registers it was read into (W read once, not again from the L2 cache). The one-pass kernel
# above stages A through shared memory once per 16 rows (as many bytes of A moved as of W, and 4 floats
# read from shared memory per element of W): the 1B step's launches ran at ~0.3-1.1 TB/s on an H200 by
# the bytes they move. Taken where a row fits one block's threads with A's VEC x R floats at most 64
# registers (rank 8 on a bfloat16 or 4-bit base, rows up to 4096 wide); elsewhere the staged kernel. On an H200
# the 1B model's launches took 0.4-0.8 ms less on bf16 and 1.4-1.6 ms less on 4-bit bases than staged (the probe's
# rows summed by hand), 128 rows x 2 the best of the layouts swept (scripts/probes/folded_launch_shapes.py; docs/bench/adapters_h200_21.txt).
_RESIDENT_A = True
RESIDENT_ROWS = 128
RESIDENT_BATCH = 2
_RESIDENT_MAX_THREADS = 512
_RESIDENT_MAX_A_REGISTERS = 64

_ROW_NORM_RESIDENT = """
    struct alignas(sizeof(WT) * VEC) WVec { WT v[VEC]; };
    constexpr int NT = IN / VEC;
    constexpr int NW = NT / 32;
    __shared__ float red[2][RB][NW];
    __shared__ float cbs[RPB * R];
    int tid = threadIdx.x;
    int lane = tid & 31;
    int warp = tid >> 5;
@LAYER_ARRAYS@
    bool ws_aligned = aligned && reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0;
    int row_begin = blockIdx.x * RPB;
    int row_end = min(row_begin + RPB, OUT);
    // s * B's column for each of the block's rows, (row, k), staged once.
    for (int e = tid; e < RPB * R; e += NT) {
        int i = row_begin + e / R;
        cbs[e] = i < OUT ? sc * b[(long long)(e % R) * OUT + i] : 0.0f;
    }
    int c0 = tid * VEC;
    float ar[VEC][R];  // A's rows for this thread's columns: (c0 + v, k), VEC * R consecutive floats
    const float* at = a + (long long)c0 * R;
    if ((VEC * R) % 4 == 0 && reinterpret_cast<unsigned long long>(at) % 16 == 0) {
        #pragma unroll
        for (int e = 0; e < VEC * R / 4; ++e) {
            float4 f = reinterpret_cast<const float4*>(at)[e];
            ar[(4 * e) / R][(4 * e) % R] = f.x;
            ar[(4 * e + 1) / R][(4 * e + 1) % R] = f.y;
            ar[(4 * e + 2) / R][(4 * e + 2) % R] = f.z;
            ar[(4 * e + 3) / R][(4 * e + 3) % R] = f.w;
        }
    } else {
        #pragma unroll
        for (int v = 0; v < VEC; ++v)
            #pragma unroll
            for (int k = 0; k < R; ++k) ar[v][k] = at[v * R + k];
    }
    __syncthreads();
    int buf = 0;
    for (int i0 = row_begin; i0 < row_end; i0 += RB) {
        WVec wv[RB];
        float dv[RB][VEC];  // MERGED: the adapted elements, W' = rs of them (unused, and dropped, otherwise)
        #pragma unroll
        for (int q = 0; q < RB; ++q) wv[q] = read_w(min(i0 + q, row_end - 1), c0);  // past the end: read, not kept
        #pragma unroll
        for (int q = 0; q < RB; ++q) {
            const float* cb = cbs + (min(i0 + q, row_end - 1) - row_begin) * R;
            float acc = 0.0f;
            #pragma unroll
            for (int v = 0; v < VEC; ++v) {
                float t = static_cast<float>(wv[q].v[v]);
                #pragma unroll
                for (int k = 0; k < R; ++k) t += ar[v][k] * cb[k];
                dv[q][v] = t;
                acc += t * t;
            }
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
            if (lane == 0) red[buf][q][warp] = acc;
        }
        __syncthreads();
        #pragma unroll
        for (int q = 0; q < RB; ++q) {
            int i = i0 + q;
            if (i >= row_end) continue;
            float total = 0.0f;
            #pragma unroll
            for (int j = 0; j < NW; ++j) total += red[buf][q][j];
            float nrm = sqrtf(total);
            float rs = static_cast<float>(static_cast<WT>(mm[i] / nrm));
            if (tid == 0) {
                norm[i] = nrm;
                rso[i] = rs;
            }
@WRITE_B@            WVec o;
            #pragma unroll
            for (int v = 0; v < VEC; ++v) o.v[v] = static_cast<WT>(rs * (MERGED ? dv[q][v] : static_cast<float>(wv[q].v[v])));
            long long off = (long long)i * IN + c0;
            if (ws_aligned) {
                *reinterpret_cast<WVec*>(ws + off) = o;
            } else {
                #pragma unroll
                for (int v = 0; v < VEC; ++v) ws[off + v] = o.v[v];
            }
        }
        buf ^= 1;
    }
"""


def _resident_layout(r: int, inp: int, vec: int) -> bool:
    """Whether the folded launch keeps A resident (_RESIDENT_A) for rank r, rows `inp` wide, `vec` columns a thread."""
    threads = inp // vec
    return (_RESIDENT_A and not _TWO_PASS and inp % (32 * vec) == 0 and threads <= _RESIDENT_MAX_THREADS
            and vec * r <= _RESIDENT_MAX_A_REGISTERS)


def row_norms_cuda(weights: list[mx.array], a: list[mx.array], b: list[mx.array],
                   scales: list[float]) -> list[mx.array]:
    """||W + s (A B)^T||_row float32 of each layer, for layers of one shape: W (out, in), A (in, r), B (r, out).

    One launch takes up to MAX_LAYERS_A_LAUNCH layers (a layer per row of blocks), so a
    model's layers of one shape cost a launch or two, not one each.
    """
    return _row_norms(weights, a, b, scales, None)[0]


def row_norms_and_scaled_cuda(weights: list[mx.array], a: list[mx.array], b: list[mx.array], scales: list[float],
                              magnitudes: list[mx.array], factors: bool = False,
                              stacked: bool = False, merged: bool = False) -> tuple[list, ...]:
    """(row_norms_cuda's norms, W' = rs W in W's dtype, rs float32) of each layer, in the same launches,
    rs = m / norm rounded to W's dtype: DoRA's row scale folded into the weights (adapted_linear's row_scale).
    With `factors` (one pass only: writes_factors()), also A and B' = B rs in W's dtype (adapted_linear's factors).
    With `stacked`, the norms are StackedNorm entries (what magnitude_grad_cuda takes without a view).
    With `merged` (one pass only), W' = rs (W + s (A B)^T): the whole adapted weight (adapted_linear's `merged`)."""
    if (factors or merged) and _TWO_PASS:
        raise ValueError("row_norms_and_scaled_cuda: the two-pass kernels do not write A and B' or a merged W'")
    return _row_norms(weights, a, b, scales, magnitudes, factors, stacked, merged)


def row_norm_kernel_name(layers: int, scaled: bool, factors: bool, packed: bool = False, resident: bool = False,
                         merged: bool = False) -> str:
    """The row-norm kernel's name for a launch of `layers` layers (with W' and rs where `scaled`, with A and B' too
    where `factors`, reading quantized weights where `packed`, holding A in registers where `resident`, writing the
    merged W' where `merged`): what MLX caches it by, and what the simulated tests count launches by."""
    kind = (("_resident" if resident else "") + ("_packed" if packed else "") + ("_merged" if merged else "")
            + ("_scaled_factors" if factors else "_scaled" if scaled else ""))
    return f"meshtune_dora_row_norm{kind}_{layers}"


def writes_factors() -> bool:
    """Whether a training step's folded norm launches write the layers' A and B' too (_WRITE_FACTORS)."""
    return _WRITE_FACTORS and not _TWO_PASS


def _row_norms(weights: list[mx.array], a: list[mx.array], b: list[mx.array], scales: list[float],
               magnitudes: list[mx.array] | None, factors: bool = False,
               stacked: bool = False, merged: bool = False) -> tuple[list[mx.array], ...]:
    """(norms,) or, with magnitudes, (norms, W', rs), and with factors (norms, W', rs, A, B'): a list each,
    a layer's entry at its index; with `stacked` the norms are StackedNorm entries, not views."""
    if len(weights) > MAX_LAYERS_A_LAUNCH:
        cut = MAX_LAYERS_A_LAUNCH

        def part(sl):
            return _row_norms(weights[sl], a[sl], b[sl], scales[sl], magnitudes and magnitudes[sl], factors, stacked,
                              merged)
        return tuple(x + y for x, y in zip(part(slice(None, cut)), part(slice(cut, None))))
    n = len(weights)
    out, inp = weights[0].shape
    wt = weights[0].dtype
    r = a[0].shape[-1]
    packed = isinstance(weights[0], PackedWeight)
    if any(isinstance(w, PackedWeight) != packed or w.shape != (out, inp) or w.dtype != wt or x.shape != (inp, r)
           or y.shape != (r, out) or packed and w[3:] != weights[0][3:] for w, x, y in zip(weights, a, b)):
        raise ValueError("row_norms_cuda: one launch takes layers of one shape, rank and weight dtype "
                         "(and one packing: bits and group size)")
    layout = _packed_layout(r, weights[0]) if packed else _row_scale_layout(r, inp, wt.size, magnitudes is not None)
    if packed and (layout is None or magnitudes is None):
        raise ValueError("row_norms_cuda: a packed weight goes to the folded launch only, where reads_packed()")
    if _TWO_PASS:
        return _row_norms_two_pass(weights, a, b, scales, magnitudes, stacked)
    scaled = magnitudes is not None
    if merged and not scaled:
        raise ValueError("row_norms_cuda: a merged W' is the folded launch's (magnitudes given)")
    names = [f"{p}{i}" for p in ("w", "qs", "qb")[:1 + 2 * packed] + ("a", "b") + (("m",) if scaled else ())
             for i in range(n)] + ["s"]
    outputs = ["norms"] + (["wss", "rss"] if scaled else []) + (["ass", "bss"] if factors else [])
    w_inputs = ([w.packed for w in weights] + [w.scales for w in weights] + [w.biases for w in weights]
                if packed else weights)
    inputs = [*w_inputs, *(x.astype(mx.float32) for x in a), *(y.astype(mx.float32) for y in b),
              *(m.astype(mx.float32) for m in magnitudes or []), kernel_constant(scales, mx.float32)]
    output_shapes = ([(n * out,)] + ([(n * out, inp), (n * out,)] if scaled else [])
                     + ([(n * inp, r), (n * r, out)] if factors else []))
    output_dtypes = [mx.float32] + ([wt, mx.float32] if scaled else []) + ([wt, wt] if factors else [])
    quantized = [("QB", weights[0].bits), ("GS", weights[0].group_size)] if packed else []
    # WT puts W's dtype in the name MLX caches the compiled kernel by (the inputs' dtypes are
    # not in it): a float32 W must not run a bfloat16 W's kernel. Likewise T and YT below.
    resident_vec = layout[1] if packed else 16 // wt.size  # a packed word a thread, else a 16-byte load
    resident = scaled and _resident_layout(r, inp, resident_vec)
    if resident:
        template = [("R", r), ("IN", inp), ("OUT", out), ("VEC", resident_vec), ("RPB", RESIDENT_ROWS),
                    ("RB", RESIDENT_BATCH), ("MERGED", int(merged)), ("WT", wt)]
        threads = inp // resident_vec
        grid = (-(-out // RESIDENT_ROWS) * threads, n, 1)
    else:
        rows, vec, tile = layout
        template = [("R", r), ("IN", inp), ("OUT", out), ("WARPS", _WARPS), ("RPW", rows), ("VEC", vec),
                    ("TJ", tile), ("G", _ROW_GROUPS), ("SQ", int(_STAGE_QUADS)), ("EB", _SCALED_LOADS),
                    ("MERGED", int(merged)), ("WT", wt)]
        threads = _WARPS * 32
        grid = (-(-out // (_WARPS * rows * _ROW_GROUPS)) * threads, n, 1)
    k = _kernel(row_norm_kernel_name(n, scaled, factors, packed, resident, merged), names, outputs,
                _row_norm_source(n, scaled, factors, packed, resident))
    res = k(inputs=inputs, template=template + quantized, grid=grid, threadgroup=(threads, 1, 1),
            output_shapes=output_shapes, output_dtypes=output_dtypes)
    return _per_layer(res, n, stacked)


def _per_layer(outputs: list[mx.array], n: int, stacked: bool = False) -> tuple[list, ...]:
    """A launch's outputs for n layers (norms, then W', then rs; each the layers' rows one after another),
    as a list of n layers' arrays each: views of the one array (layer_views), no copies. With `stacked` the
    norms (the first output) are StackedNorm entries instead."""
    views = [layer_views(x, n) for x in outputs[stacked:]]
    if not stacked:
        return tuple(views)
    size = outputs[0].size // n
    return ([StackedNorm(outputs[0], i * size, size) for i in range(n)],
            *views)


# MLX's split is one graph node (a Split, its parts siblings) for up to 10 parts and a Slice a part beyond
# (mlx/ops.cpp). The 1B model's four launches (32, 32, 32 and 16 layers) made a Slice a layer for each of W', A
# and B': 336 nodes a step, each built and dispatched by the host on every step (graph_nodes.py --cuda); split in
# groups of at most 10 they are 5 or 3 Split nodes a launch's output.
SPLIT_PARTS = 10


def layer_views(x: mx.array, n: int) -> list[mx.array]:
    """x's n equal parts along axis 0, views of it, from nested splits of at most SPLIT_PARTS parts each."""
    if n == 1:
        return [x]
    if n <= SPLIT_PARTS:
        return mx.split(x, n)
    size = -(-n // min(SPLIT_PARTS, -(-n // SPLIT_PARTS)))  # parts a group (at most SPLIT_PARTS groups), the last the rest
    starts = range(0, n, size)
    groups = mx.split(x, [start * (x.shape[0] // n) for start in starts[1:]])
    return [view for group, start in zip(groups, starts) for view in layer_views(group, min(size, n - start))]


# Two passes (_TWO_PASS): the norms by segments of columns, then W' row by row. The one-pass kernel
# above stages all of A once per 16 rows of W (as many bytes through shared memory as of W) and
# keeps one block of 8 warps an SM (141 registers a thread). Here a thread takes a row: pass 1's
# block of SEGMENT_THREADS rows x SEGMENT columns stages A's rows for its columns once, every
# thread reading the same value of A at once (a broadcast), and writes each row's sum of d_j^2
# over its segment; pass 2 (a warp a row, as the one-pass kernel's epilogue) adds a row's
# segments in order, takes rs = m / norm and writes W' = rs W with SCALED_LOADS loads a lane in
# flight. W is read twice from memory (the one-pass kernel rereads rows from the L2 cache), in
# exchange for blocks small in registers and many of them (ptxas: 46-123 registers a thread in
# pass 1, 26-31 in pass 2, against 141; scripts/probes/kernel_registers.py). On one H200 the 1B
# step's 4 shapes (112 layers) took 2.48 ms (eval, dora_kernel_cost.py) against the one-pass kernel's 2.53 in
# the same invocation, and the DoRA step 64.2 ms against 61.2 (probe_dora_step.py, 60 steps: within
# that run's spread); no gain, so the one-pass kernel stays the default
# (docs/bench/dora_two_pass_h200.txt).
_TWO_PASS = False
_SEGMENT = 256  # columns of W a pass-1 block takes
_SEGMENT_THREADS = 128  # rows of W a pass-1 block takes, a thread each
_SEGMENT_LOADS = 8  # 16-byte loads of its row a thread has in flight (8: a 128-byte line)

_SEGMENT_SUMS = """
    // Block: NT threads, thread t on row rb * NT + t of W, over segment sg of SEG columns
    // (blockIdx.x = rb * SEGS + sg) of layer blockIdx.y; a switch points w, a and b at
    // that layer's arrays. Each thread sums d_j^2 over its row's columns in the segment, j in
    // order, d_j = w_ij + s sum_k A_jk B_ki (k in order, as the one-pass kernel forms it); A's
    // rows for the segment pass through shared memory in tiles of TJ rows, each value read by
    // every thread at once.
    struct alignas(sizeof(WT) * VEC) WVec { WT v[VEC]; };
    constexpr int SEGS = (IN + SEG - 1) / SEG;
    __shared__ float4 sa4[(TJ * R + 3) / 4];
    float* sa = reinterpret_cast<float*>(sa4);
    int tid = threadIdx.x;
    const WT* w;
    const float* a;
    const float* b;
    @SELECT@
    float sc = s[blockIdx.y];
    int sg = blockIdx.x % SEGS;
    int i = (blockIdx.x / SEGS) * NT + tid;
    bool live = i < OUT;
    float cb[R];
    #pragma unroll
    for (int k = 0; k < R; ++k) cb[k] = live ? sc * b[(long long)k * OUT + i] : 0.0f;
@READ_W@
    int end = min(IN, (sg + 1) * SEG);
    float sq = 0.0f;
    #pragma unroll 1
    for (int j0 = sg * SEG; j0 < end; j0 += TJ) {
        int n = min(TJ, end - j0);
        const float* at = a + (long long)j0 * R;
        __syncthreads();  // the last tile's reads are done
        if (reinterpret_cast<unsigned long long>(at) % 16 == 0 && (n * R) % 4 == 0) {
            const float4* at4 = reinterpret_cast<const float4*>(at);
            for (int e = tid; e < n * R / 4; e += NT) sa4[e] = at4[e];
        } else {
            for (int e = tid; e < n * R; e += NT) sa[e] = at[e];
        }
        __syncthreads();
        if (!live) continue;
        #pragma unroll 1
        for (int c = 0; c < n; c += VEC * U) {
            WVec wv[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                int col = c + u * VEC;
                if (col < n) wv[u] = read_w(i, j0 + col);
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                int col = c + u * VEC;
                if (col >= n) continue;
                #pragma unroll
                for (int v = 0; v < VEC; ++v) {
                    float d = static_cast<float>(wv[u].v[v]);
                    int e = (col + v) * R;
                    if (R % 4 == 0) {
                        #pragma unroll
                        for (int h = 0; h < R / 4; ++h) {
                            float4 q = sa4[e / 4 + h];
                            d += q.x * cb[4 * h];
                            d += q.y * cb[4 * h + 1];
                            d += q.z * cb[4 * h + 2];
                            d += q.w * cb[4 * h + 3];
                        }
                    } else {
                        #pragma unroll
                        for (int k = 0; k < R; ++k) d += sa[e + k] * cb[k];
                    }
                    sq += d * d;
                }
            }
        }
    }
    if (live) part[((long long)blockIdx.y * SEGS + sg) * OUT + i] = sq;
""".replace("@READ_W@", _READ_W)

# Pass 2 with W' (row_norms_and_scaled_cuda): a warp a row; without (row_norms_cuda): a thread a row.
_SCALE_ROWS = """
    // Block: WARPS warps, a warp on row blockIdx.x * WARPS + warp of layer blockIdx.y: the row's norm
    // from pass 1's sums (its segments added in order), rs = m / norm rounded to W's dtype as the MLX
    // ops round it, and W' = rs W, EB 16-byte loads a lane in flight before their stores.
    struct alignas(sizeof(WT) * VEC) WVec { WT v[VEC]; };
    constexpr int SEGS = (IN + SEG - 1) / SEG;
    const WT* w;
    const float* mm;
    @SELECT@
@LAYER_OUTPUTS@
    int lane = threadIdx.x & 31;
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (i >= OUT) return;
    const float* ps = part + (long long)blockIdx.y * SEGS * OUT + i;
    float total = 0.0f;
    for (int k = 0; k < SEGS; ++k) total += ps[(long long)k * OUT];
    float nrm = sqrtf(total);
    float rs = static_cast<float>(static_cast<WT>(mm[i] / nrm));
    if (lane == 0) {
        norm[i] = nrm;
        rso[i] = rs;
    }
@READ_W@
    long long row = (long long)i * IN;
    bool ws_aligned = aligned && reinterpret_cast<unsigned long long>(ws) % sizeof(WVec) == 0;
@WRITE_SCALED_ROW@
""".replace("@WRITE_SCALED_ROW@", _WRITE_SCALED_ROW.replace("@READ_ROW@", "read_w")).replace("@READ_W@", _READ_W).replace(
    "@LAYER_OUTPUTS@", _NORM_OUTPUT + "\n" + _SCALED_OUTPUTS)
_NORMS_FROM_SUMS = """
    // A thread a row of layer blockIdx.y: its segments' sums added in order (pass 2's), the root taken.
    constexpr int SEGS = (IN + SEG - 1) / SEG;
@LAYER_OUTPUTS@
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= OUT) return;
    const float* ps = part + (long long)blockIdx.y * SEGS * OUT + i;
    float total = 0.0f;
    for (int k = 0; k < SEGS; ++k) total += ps[(long long)k * OUT];
    norm[i] = sqrtf(total);
""".replace("@LAYER_OUTPUTS@", _NORM_OUTPUT)


def _row_norms_two_pass(weights: list[mx.array], a: list[mx.array], b: list[mx.array], scales: list[float],
                        magnitudes: list[mx.array] | None, stacked: bool = False) -> tuple[list[mx.array], ...]:
    """_row_norms by the two passes (_TWO_PASS), for at most MAX_LAYERS_A_LAUNCH layers of one shape."""
    n = len(weights)
    out, inp = weights[0].shape
    wt = weights[0].dtype
    r = a[0].shape[-1]
    vec = 16 // wt.size
    while vec > 1 and inp % vec:
        vec //= 2
    seg = _SEGMENT
    segs = -(-inp // seg)
    tile = min(seg, max(1, _default_tile_floats(r) // r))
    common = [("IN", inp), ("OUT", out), ("SEG", seg), ("VEC", vec), ("WT", wt)]
    sums = _kernel(f"meshtune_dora_segment_sums_{n}", [f"{p}{i}" for p in "wab" for i in range(n)] + ["s"], ["part"],
                   _SEGMENT_SUMS.replace("@SELECT@", _select(n, "w = w{i}; a = a{i}; b = b{i};")))
    (part,) = sums(inputs=[*weights, *(x.astype(mx.float32) for x in a), *(y.astype(mx.float32) for y in b),
                           kernel_constant(scales, mx.float32)],
                   template=[("R", r), *common, ("NT", _SEGMENT_THREADS), ("TJ", tile), ("U", _SEGMENT_LOADS)],
                   grid=(-(-out // _SEGMENT_THREADS) * segs * _SEGMENT_THREADS, n, 1),
                   threadgroup=(_SEGMENT_THREADS, 1, 1), output_shapes=[(n, segs, out)], output_dtypes=[mx.float32])
    if magnitudes is None:
        k = _kernel(f"meshtune_dora_norms_from_sums_{n}", ["part"], ["norms"], _NORMS_FROM_SUMS)
        res = k(inputs=[part], template=common, grid=(-(-out // 256) * 256, n, 1), threadgroup=(256, 1, 1),
                output_shapes=[(n * out,)], output_dtypes=[mx.float32])
        return _per_layer(res, n)
    names = [f"{p}{i}" for p in ("w", "m") for i in range(n)] + ["part"]
    k = _kernel(f"meshtune_dora_scale_rows_{n}", names, ["norms", "wss", "rss"],
                _SCALE_ROWS.replace("@SELECT@", _select(n, "w = w{i}; mm = m{i};")))
    res = k(inputs=[*weights, *(m.astype(mx.float32) for m in magnitudes), part],
            template=[*common, ("WARPS", _WARPS), ("EB", _SCALED_LOADS)],
            grid=(-(-out // _WARPS) * _WARPS * 32, n, 1), threadgroup=(_WARPS * 32, 1, 1),
            output_shapes=[(n * out,), (n * out, inp), (n * out,)], output_dtypes=[mx.float32, wt, mx.float32])
    return _per_layer(res, n, stacked)


def cotangent_grid(rows: int, cols: int, dtype: mx.Dtype) -> tuple[int, int, int, int]:
    """(columns a thread takes, column strips, rows a chunk, chunks) of the cotangent kernel's blocks."""
    vec = 16 // dtype.size
    vec = vec if cols % vec == 0 else 1
    strips = -(-cols // (32 * vec))
    chunk = -(-rows // max(1, min(-(-_COTANGENT_BLOCKS // strips), rows // 32)))
    return vec, strips, chunk, -(-rows // chunk)


class StackedNorm(NamedTuple):
    """A layer's row norms where its step's launch wrote them: entries start .. start + size of the launch's
    one array (its layers' norms one after another). The magnitude-gradient kernel reads them there, so a
    training step's graph holds no view of them (a node a layer); `view()` is that view, for MLX ops."""

    launch: mx.array
    start: int
    size: int

    def view(self) -> mx.array:
        return self.launch[self.start:self.start + self.size]


def _norm_input(norm: mx.array | StackedNorm) -> tuple[mx.array, mx.array]:
    """(norms array, int32 offset of the layer's first in entry 0) for the magnitude-gradient kernel."""
    start = norm.start if isinstance(norm, StackedNorm) else 0
    return (norm.launch if isinstance(norm, StackedNorm) else norm), kernel_constant([start], mx.int32)


def cotangent_cuda(g: mx.array, y: mx.array, m: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs in g's dtype, sum_t g * y / (rs * norm) float32, 0 where rs * norm is 0) for (rows, cols) g, y.

    rs = m / norm rounded to g's dtype; m and norm are float32 (cols,).
    """
    rows, cols = g.shape
    vec, strips, chunk, chunks = cotangent_grid(rows, cols, g.dtype)
    k = _kernel("meshtune_dora_cotangent", ["g", "y", "m", "norm"], ["gz", "part"], _COTANGENT)
    gz, part = k(inputs=[g, y, m.astype(mx.float32), norm], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                                   ("T", g.dtype), ("YT", y.dtype)],
                 grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                 output_shapes=[(rows, cols), (chunks, cols)], output_dtypes=[g.dtype, mx.float32])
    return gz, _magnitude_from_sums(part, m, norm, g.dtype)


def magnitude_grad_cuda(g: mx.array, y: mx.array, m: mx.array, norm: mx.array | StackedNorm,
                        b_product: mx.array | None = None, b_scale: float = 1.0, rs_dtype: mx.Dtype | None = None):
    """sum_t g * y / (rs * norm) float32 (0 where rs * norm is 0) for (rows, cols) g, y: cotangent_cuda's
    second result without its first, for a product that applies rs in its weights (adapted_linear's row_scale).

    rs = m / norm rounded to `rs_dtype` (default g's). With `b_product` (r, cols), (x A)^T g for B' = B rs,
    returns (m's gradient, B's = (b_scale * b_product in its dtype) * rs float32), in the same launch: the
    scale's multiply is no operation of its own in the step.
    """
    return _magnitude_from_sums(column_sums(g, y), m, norm, rs_dtype or g.dtype, b_product, b_scale)


def b_sums_grid(rows: int, cols: int, r: int, dtype: mx.Dtype) -> tuple[int, int, int, int]:
    """(columns a thread takes, column strips, rows a chunk, chunks) of the B sums' blocks (B_PRODUCT_IN_SUMS)."""
    vec = 16 // dtype.size
    while vec > 1 and (cols % vec or r * vec > _B_SUMS_FLOATS):
        vec //= 2
    strips = -(-cols // (32 * vec))
    chunk = -(-rows // max(1, min(-(-_B_SUMS_BLOCKS // strips), rows // 32)))
    return vec, strips, chunk, -(-rows // chunk)


def magnitude_and_b_grad_cuda(g: mx.array, y: mx.array, u: mx.array, m: mx.array, norm: mx.array | StackedNorm,
                              b_scale: float, rs_dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
    """(m's gradient, B's) for the folded product, B's product (x A)^T g taken in the column sums' pass
    (B_PRODUCT_IN_SUMS): magnitude_grad_cuda(g, y, m, norm, b_product=u.T @ g, b_scale=, rs_dtype=) without the
    matmul, p's sum in float32 by chunks of rows (a different order from a matmul's: equal to rounding).

    g, y (rows, cols) in the activations' dtype, u = x A (rows, r) in the same; m float32, norm as there.
    """
    rows, cols = g.shape
    r = u.shape[-1]
    vec, strips, chunk, chunks = b_sums_grid(rows, cols, r, g.dtype)
    sums = _kernel("meshtune_dora_column_and_b_sums", ["g", "y", "u"], ["part", "bpart"], _COLUMN_AND_B_SUMS)
    part, bpart = sums(inputs=[g, y, u], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                                   ("R", r), ("T", g.dtype), ("YT", y.dtype), ("UT", u.dtype)],
                       grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                       output_shapes=[(chunks, cols), (chunks, r, cols)], output_dtypes=[mx.float32, mx.float32])
    norms, offset = _norm_input(norm)
    k = _kernel("meshtune_dora_magnitude_b_sums_grad", ["part", "m", "norms", "off", "bpart", "bscale"], ["dm", "gbo"],
                _MAGNITUDE_AND_B_SUMS)
    dm, gb = k(inputs=[part, m.astype(mx.float32), norms, offset, bpart, kernel_constant([b_scale], mx.float32)],
               template=[("COLS", cols), ("CHUNKS", chunks), ("T", rs_dtype or g.dtype), ("R", r), ("GT", g.dtype)],
               grid=(-(-cols // 32) * 32 * _SUM_WARPS, 1, 1), threadgroup=(32 * _SUM_WARPS, 1, 1),
               output_shapes=[(cols,), (r, cols)], output_dtypes=[mx.float32, mx.float32])
    return dm, gb


def column_sums(g: mx.array, y: mx.array) -> mx.array:
    """sum_t g * y float32 by chunks of rows, (chunks, cols): the first of m's gradient's two launches."""
    rows, cols = g.shape
    vec, strips, chunk, chunks = cotangent_grid(rows, cols, g.dtype)
    k = _kernel("meshtune_dora_column_sums", ["g", "y"], ["part"], _COLUMN_SUMS)
    (part,) = k(inputs=[g, y], template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                                         ("T", g.dtype), ("YT", y.dtype)],
                grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                output_shapes=[(chunks, cols)], output_dtypes=[mx.float32])
    return part


def _magnitude_from_sums(part: mx.array, m: mx.array, norm: mx.array | StackedNorm, dtype: mx.Dtype,
                         b_product: mx.array | None = None, b_scale: float = 1.0):
    """m's gradient from the chunks' column sums (chunks, cols), added in a fixed order; with `b_product`, B's too."""
    chunks, cols = part.shape
    norms, offset = _norm_input(norm)
    inputs = [part, m.astype(mx.float32), norms, offset]
    template = [("COLS", cols), ("CHUNKS", chunks), ("T", dtype)]
    grid = dict(grid=(-(-cols // 32) * 32 * _SUM_WARPS, 1, 1), threadgroup=(32 * _SUM_WARPS, 1, 1))  # 32 columns a block
    if b_product is None:
        k = _kernel("meshtune_dora_magnitude_grad", ["part", "m", "norms", "off"], ["dm"], _MAGNITUDE_GRAD)
        (dm,) = k(inputs=inputs, template=template, output_shapes=[(cols,)], output_dtypes=[mx.float32], **grid)
        return dm
    r = b_product.shape[0]
    k = _kernel("meshtune_dora_magnitude_b_grad", ["part", "m", "norms", "off", "gb", "bscale"], ["dm", "gbo"],
                _MAGNITUDE_AND_B_GRAD)
    scale = kernel_constant([b_scale], mx.float32)
    dm, gb = k(inputs=inputs + [b_product, scale], template=template + [("R", r), ("GT", b_product.dtype)],
               output_shapes=[(cols,), (r, cols)], output_dtypes=[mx.float32, mx.float32], **grid)
    return dm, gb
