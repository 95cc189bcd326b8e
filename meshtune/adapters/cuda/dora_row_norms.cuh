// DoRA's row norms ||W + s (A B)^T||_row, and for the folded step W' = rs W (or, MERGED, the whole adapted
// weight rs (W + s (A B)^T)), rs = m / norm rounded to W's dtype, A and B' = B rs in W's dtype.
// Loaded by meshtune/adapters/kernels.py (row_norms_cuda, row_norms_and_scaled_cuda).
//
// A launch takes the layers of one shape, layer blockIdx.y; the launch's switch hands its arrays here.
// Inputs (a layer's): W (OUT, IN) in WT, or where QB > 0 packed: (OUT, IN * QB / 32) uint32 words with scales
//   and biases (OUT, IN / GS) in WT; A (IN, R) float32; B (R, OUT) float32; m (OUT) float32 (FOLDED only);
//   s (layers) float32, the layers' scales.
// Outputs (one array each for the launch's layers, layer L's part at L times a layer's size): norms (OUT)
//   float32; FOLDED: W' (OUT, IN) in WT, rs (OUT) float32, A (IN, R) and B' (R, OUT) in WT.
// Launch, staged (row_norms_staged): grid ceil(OUT / (WARPS * RPW)) x layers blocks, WARPS * 32 threads a block.
//   Resident (row_norms_resident, FOLDED only): grid ceil(OUT / RPB) x layers blocks, IN / VEC threads a block.
// Checked by tests/cuda/test_sim_row_norms.py (simulated, against MLX ops) and tests/cuda/test_kernels_nvcc.py.

#ifndef MESHTUNE_DORA_ROW_NORMS_CUH  // a translation unit of several kernels holds it once
#define MESHTUNE_DORA_ROW_NORMS_CUH

namespace dora {

template <class WT, int VEC>
struct alignas(sizeof(WT) * VEC) Vec {
  WT v[VEC];
};

__device__ __forceinline__ bool aligned_to(const void* p, unsigned long long bytes) {
  return reinterpret_cast<unsigned long long>(p) % bytes == 0;
}

// VEC elements of W's row `row` from column `col` (a multiple of VEC). Dense (QB = 0): one 16-byte load where
// W is aligned. Packed: the VEC = 32 / QB elements of one word, all in one group of GS, each q * scale + bias in
// float32 rounded once to WT, as MLX's CUDA dequantize gives them (so no layer dequantizes a copy first).
template <int IN, int VEC, int QB, int GS, class WT, class WIn>
struct WeightRows {
  const WIn* w;
  const WT* qs;
  const WT* qb;
  bool aligned;  // packed: a lane's VEC elements come from one word, and W' is written by 16-byte stores

  __device__ WeightRows(const WIn* w_, const WT* qs_, const WT* qb_) : w(w_), qs(qs_), qb(qb_) {
    if constexpr (QB == 0) {
      aligned = VEC > 1 && aligned_to(w, sizeof(Vec<WT, VEC>));
    } else {
      aligned = true;
    }
  }

  __device__ __forceinline__ Vec<WT, VEC> operator()(int row, int col) const {
    Vec<WT, VEC> r;
    if constexpr (QB == 0) {
      long long off = (long long)row * IN + col;
      if (aligned) {
        r = *reinterpret_cast<const Vec<WT, VEC>*>(w + off);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) r.v[v] = w[off + v];
      }
    } else {
      long long e = (long long)row * IN + col;
      unsigned word = w[e / VEC];
      float sc = static_cast<float>(qs[e / GS]);
      float bi = static_cast<float>(qb[e / GS]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float q = static_cast<float>((word >> (v * QB)) & ((1u << QB) - 1u));
        r.v[v] = static_cast<WT>(q * sc + bi);
      }
    }
    return r;
  }
};

// VEC elements of row i of W' from column c, where they are already stored (the merged staged kernel's d).
template <int IN, int VEC, class WT>
__device__ __forceinline__ Vec<WT, VEC> read_stored(const WT* ws, int i, int c) {
  Vec<WT, VEC> r;
  long long off = (long long)i * IN + c;
  if (aligned_to(ws, sizeof(Vec<WT, VEC>))) {
    r = *reinterpret_cast<const Vec<WT, VEC>*>(ws + off);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) r.v[v] = ws[off + v];
  }
  return r;
}

// The layer's A in W's dtype (the factors' A), the layer's blocks striding over it.
template <int IN, int R, int NT, class WT>
__device__ __forceinline__ void write_a(const float* a, WT* aso) {
  for (long long e = (long long)blockIdx.x * NT + threadIdx.x; e < (long long)IN * R; e += (long long)gridDim.x * NT)
    aso[e] = static_cast<WT>(a[e]);
}

// Staged: WARPS warps, RPW adjacent rows of W each. Element j of a row's adapted weight is
// d_j = w_ij + s sum_k A_jk B_ki; the lanes sum d_j^2 over the columns they take, the adapted row never stored
// (no Gram, no cancellation between an identity's terms). Tiles of TJ rows of A pass through shared memory
// transposed and padded (sa[k * SA + j], SA = TJ + 4: staging writes hit distinct banks); a lane takes VEC
// consecutive columns a pass (a 16-byte load of each of its rows, all of a tile's loads issued before its
// arithmetic) and reads A's values for them as float4s, half-swizzled so a quarter-warp's reads hit distinct
// banks; each value read serves RPW rows. FOLDED: after the norms each warp reads its rows again (from the L2
// cache) and writes W' = rs W; MERGED: d is stored in W' in the tile loop and the epilogue scales it.
template <int WARPS, int R, int IN, int OUT, int RPW, int VEC, int TJ, int FOLDED, int MERGED, int QB, int GS,
          class WT, class WIn>
__device__ void row_norms_staged(const WIn* w, const WT* qs, const WT* qb, const float* a, const float* b,
                                 const float* mm, const float* s, float* norms, WT* wss, float* rss, WT* ass,
                                 WT* bss) {
  using WVec = Vec<WT, VEC>;
  constexpr int NT = WARPS * 32;
  constexpr int SA = TJ + 4;
  constexpr int P = TJ / (32 * VEC);  // passes over a full tile
  __shared__ float4 sa4[R * SA / 4];
  float* sa = reinterpret_cast<float*>(sa4);
  int tid = threadIdx.x;
  int lane = tid & 31;
  float sc = s[blockIdx.y];
  float* norm = norms + (long long)blockIdx.y * OUT;
  WeightRows<IN, VEC, QB, GS, WT, WIn> read_w(w, qs, qb);
  WT* ws = FOLDED ? wss + (long long)blockIdx.y * OUT * IN : nullptr;
  int row0 = (blockIdx.x * WARPS + (tid >> 5)) * RPW;  // the warp's first row
  float sq[RPW];
#pragma unroll
  for (int q = 0; q < RPW; ++q) sq[q] = 0.0f;
  WVec wr[P][RPW];
  // s * B's column for each of the warp's rows, loaded once (not again for every tile of A).
  float cb[RPW][R];
#pragma unroll
  for (int q = 0; q < RPW; ++q)
#pragma unroll
    for (int k = 0; k < R; ++k) {
      int i = row0 + q;
      cb[q][k] = i < OUT ? sc * b[k * OUT + i] : 0.0f;
    }
  // A's tile is n * R consecutive floats, staged by float4 loads, four of them a thread in flight before their
  // stores (a round trip to the L2 cache per four, not one per float); the rest, or a misaligned A, by floats.
  bool a_quads = aligned_to(a, 16);
  for (int j0 = 0; j0 < IN; j0 += TJ) {
    int n = min(TJ, IN - j0);  // a multiple of VEC (IN and TJ are)
    // The warp's loads of W in flight while A is staged.
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
          if constexpr (VEC >= 4) {
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
        if constexpr (FOLDED && MERGED) {  // d stored in W' (rounded to WT) for the epilogue to scale
          bool ws_vec = aligned_to(ws, sizeof(WVec));
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
#pragma unroll
        for (int q = 0; q < RPW; ++q)
#pragma unroll
          for (int v = 0; v < VEC; ++v) sq[q] += t[q][v] * t[q][v];
      }
    }
    __syncthreads();
  }
  // Each row's sum over the warp's lanes by a fixed butterfly (deterministic); every lane holds it after.
#pragma unroll
  for (int q = 0; q < RPW; ++q) {
    for (int off = 16; off > 0; off >>= 1) sq[q] += __shfl_xor_sync(0xffffffff, sq[q], off);
    int i = row0 + q;
    if (lane == q && i < OUT) norm[i] = sqrtf(sq[q]);
  }
  if constexpr (FOLDED) {
    float* rso = rss + (long long)blockIdx.y * OUT;
    WT* bso = bss + (long long)blockIdx.y * R * OUT;
    bool ws_aligned = read_w.aligned && aligned_to(ws, sizeof(WVec));
#pragma unroll
    for (int q = 0; q < RPW; ++q) {
      int i = row0 + q;
      if (i >= OUT) continue;
      float rs = static_cast<float>(static_cast<WT>(mm[i] / sqrtf(sq[q])));
      if (lane == q) rso[i] = rs;
      // B' = B rs for row i (B is (R, OUT): column i), by the warp's lanes.
      for (int k = lane; k < R; k += 32) bso[(long long)k * OUT + i] = static_cast<WT>(b[(long long)k * OUT + i] * rs);
      long long row = (long long)i * IN;
      // Row i of W' = rs W (MERGED: rs d, d read back from W'), a 16-byte load and store a lane at a time.
      for (int c = lane * VEC; c < IN; c += 32 * VEC) {
        WVec in = MERGED ? read_stored<IN, VEC>(ws, i, c) : read_w(i, c);
        WVec out;
#pragma unroll
        for (int v = 0; v < VEC; ++v) out.v[v] = static_cast<WT>(rs * static_cast<float>(in.v[v]));
        if (ws_aligned) {
          *reinterpret_cast<WVec*>(ws + row + c) = out;
        } else {
#pragma unroll
          for (int v = 0; v < VEC; ++v) ws[row + c + v] = out.v[v];
        }
      }
    }
    write_a<IN, R, NT>(a, ass + (long long)blockIdx.y * IN * R);
  }
}

// Resident (folded only): a thread takes VEC consecutive columns of every row (IN = VEC x the block's threads) and
// holds A's rows for those columns in registers, loaded once a block; the block takes RPB rows of one layer, RB at
// a time: their loads in flight together, each row's d_j squared and summed by the thread, the warps' sums added
// through shared memory (one barrier a batch), and W' = rs W (MERGED: rs d) written from the registers the row was
// read into (W read once). Taken where a row fits one block and A's VEC x R floats fit in registers.
template <int R, int IN, int OUT, int VEC, int RPB, int RB, int MERGED, int QB, int GS, class WT, class WIn>
__device__ void row_norms_resident(const WIn* w, const WT* qs, const WT* qb, const float* a, const float* b,
                                   const float* mm, const float* s, float* norms, WT* wss, float* rss, WT* ass,
                                   WT* bss) {
  using WVec = Vec<WT, VEC>;
  constexpr int NT = IN / VEC;
  constexpr int NW = NT / 32;
  __shared__ float red[2][RB][NW];
  __shared__ float cbs[RPB * R];
  int tid = threadIdx.x;
  int lane = tid & 31;
  int warp = tid >> 5;
  float sc = s[blockIdx.y];
  float* norm = norms + (long long)blockIdx.y * OUT;
  WT* ws = wss + (long long)blockIdx.y * OUT * IN;
  float* rso = rss + (long long)blockIdx.y * OUT;
  WT* bso = bss + (long long)blockIdx.y * R * OUT;
  WeightRows<IN, VEC, QB, GS, WT, WIn> read_w(w, qs, qb);
  bool ws_aligned = read_w.aligned && aligned_to(ws, sizeof(WVec));
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
  if ((VEC * R) % 4 == 0 && aligned_to(at, 16)) {
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
    float dv[RB][VEC];  // the adapted elements (MERGED: W' = rs of them; unused, and dropped, otherwise)
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
      // B' = B rs for row i, by the block's threads.
      for (int k = tid; k < R; k += NT) bso[(long long)k * OUT + i] = static_cast<WT>(b[(long long)k * OUT + i] * rs);
      WVec o;
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
  write_a<IN, R, NT>(a, ass + (long long)blockIdx.y * IN * R);
}

}  // namespace dora

#endif  // MESHTUNE_DORA_ROW_NORMS_CUH
