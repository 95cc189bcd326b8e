// DoRA's backward pass over the cotangent g: column sums sum_t g * y by chunks of rows, and with them either the
// row-scaled cotangent g * rs (the unfolded product) or, for the folded product, B's product (x A)^T g.
// Loaded by meshtune/adapters/kernels.py (cotangent_cuda; magnitude_and_b_grad_cuda's first launch).
// dora_magnitude_grad.cuh's kernel adds the chunks in a fixed order.
//
// Inputs: g, y (ROWS, COLS) in T and YT; SCALE_G: m and the norms (COLS) float32 (rs = m / norm rounded to T);
//   R > 0: u = x A (ROWS, R) in UT.
// Outputs: part (chunks, COLS) float32, a chunk's column sums a row; SCALE_G: gz = g * rs (ROWS, COLS) in T;
//   R > 0: bpart (chunks, R, COLS) float32, a chunk's sums of u_tk g_ti.
// Launch: grid ceil(COLS / (32 * VEC)) x chunks blocks of 256 threads: 8 warps on 32 * VEC columns, a thread on
//   VEC consecutive columns (one 16-byte access where aligned), the warps striding over the block's CHUNK rows.
// Checked by tests/cuda/test_sim_cotangent.py, test_sim_magnitude_grad.py (simulated) and test_kernels_nvcc.py.

#ifndef MESHTUNE_DORA_COTANGENT_CUH  // a translation unit of several kernels holds it once
#define MESHTUNE_DORA_COTANGENT_CUH

namespace dora {

template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Lanes {
  T v[VEC];
};

// A block's 8 warps' column sums of `vals` (this thread's VEC columns) added in warp order into
// `out`'s CB = 32 * VEC columns of this block, through the shared `sums`.
template <int VEC, int COLS>
__device__ void block_sums(float (*sums)[32 * VEC], const float* vals, float* out, int tid, int lane, int warp) {
  for (int v = 0; v < VEC; ++v) sums[warp][lane * VEC + v] = vals[v];
  __syncthreads();
  for (int c = tid; c < 32 * VEC; c += 256) {
    int col = blockIdx.x * 32 * VEC + c;
    if (col < COLS) {
      float total = 0.0f;
      for (int w = 0; w < 8; ++w) total += sums[w][c];
      out[col] = total;
    }
  }
}

template <int SCALE_G, int R, int ROWS, int COLS, int CHUNK, int VEC, class T, class YT, class UT>
__device__ void column_pass(const T* g, const YT* y, const UT* u, const float* m, const float* norm, T* gz,
                            float* part, float* bpart) {
  static_assert(SCALE_G || R > 0, "the pass writes g * rs or sums B's product");
  using Vec = Lanes<T, VEC>;
  using YVec = Lanes<YT, VEC>;
  constexpr int CB = 32 * VEC;
  __shared__ float sums[8][CB];
  int tid = threadIdx.x;
  int lane = tid & 31;
  int warp = tid >> 5;
  int c0 = blockIdx.x * CB + lane * VEC;
  int t0 = blockIdx.y * CHUNK;
  int t1 = min(t0 + CHUNK, ROWS);
  auto at = [](const void* p, unsigned long long bytes) {
    return reinterpret_cast<unsigned long long>(p) % bytes == 0;
  };
  bool aligned = VEC > 1 && at(g, sizeof(Vec)) && at(y, sizeof(YVec)) && (!SCALE_G || at(gz, sizeof(Vec)));
  float acc[VEC];
  float r[SCALE_G ? VEC : 1];  // DoRA's row scale rs = m / norm, rounded to T as the MLX ops round it
  if constexpr (SCALE_G) {
    for (int v = 0; v < VEC; ++v)
      r[v] = c0 + v < COLS ? static_cast<float>(static_cast<T>(m[c0 + v] / norm[c0 + v])) : 0.0f;
  }
  float bacc[R > 0 ? R : 1][VEC];
  if constexpr (R > 0) {
#pragma unroll
    for (int k = 0; k < R; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) bacc[k][v] = 0.0f;
  }
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  if (c0 < COLS) {  // COLS is a multiple of VEC: a thread's columns are all in or all out
    for (int t = t0 + warp; t < t1; t += 8) {
      long long off = (long long)t * COLS + c0;
      Vec gv;
      YVec yv;
      if (aligned) {
        gv = *reinterpret_cast<const Vec*>(g + off);
        yv = *reinterpret_cast<const YVec*>(y + off);
      } else {
        for (int v = 0; v < VEC; ++v) {
          gv.v[v] = g[off + v];
          yv.v[v] = y[off + v];
        }
      }
      if constexpr (SCALE_G) {
        Vec out;
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
      } else {
        float uk[R];
#pragma unroll
        for (int k = 0; k < R; ++k) uk[k] = static_cast<float>(u[(long long)t * R + k]);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          float gf = static_cast<float>(gv.v[v]);
          acc[v] += gf * static_cast<float>(yv.v[v]);
#pragma unroll
          for (int k = 0; k < R; ++k) bacc[k][v] += uk[k] * gf;
        }
      }
    }
  }
  // The block's sums to its row of `part`, the warps' added in warp order.
  block_sums<VEC, COLS>(sums, acc, part + (long long)blockIdx.y * COLS, tid, lane, warp);
  if constexpr (R > 0) {  // then B's rows, one at a time through the same shared buffer
#pragma unroll
    for (int k = 0; k < R; ++k) {
      __syncthreads();  // the shared sums' last reads are done
      block_sums<VEC, COLS>(sums, bacc[k], bpart + ((long long)blockIdx.y * R + k) * COLS, tid, lane, warp);
    }
  }
}

}  // namespace dora

#endif  // MESHTUNE_DORA_COTANGENT_CUH
