// DoRA's magnitude gradient dm = sum over chunks of dora_cotangent.cuh's column sums / (rs * norm) (0 where
// rs * norm is 0), the chunks added in a fixed order; with WITH_B, B's gradient (s p rounded to GT) rs too, p the
// chunks' sums of (x A)^T g rounded to GT as a matmul's output is, s rounded to GT as MLX casts a Python scalar.
// Loaded by meshtune/adapters/kernels.py (cotangent_cuda's and magnitude_and_b_grad_cuda's second launch).
//
// Inputs: part (CHUNKS, COLS) float32; m (COLS) float32; norms float32, the layer's from entry off[0] (a launch's
//   stacked norms, or an array of the layer's own with off 0); WITH_B: bpart (CHUNKS, R, COLS) float32, bscale
//   (1) float32. rs = m / norm rounded to T.
// Outputs: dm (COLS) float32; WITH_B: gbo (R, COLS) float32.
// Launch: grid ceil(COLS / 32) blocks of WARPS * 32 threads: a block on 32 columns, warp j summing chunks
//   j, j + WARPS, ... (a warp's reads 32 adjacent floats), then each column adding the warps' sums in warp order.
// Checked by tests/cuda/test_sim_magnitude_grad.py, test_sim_cotangent.py (simulated) and test_kernels_nvcc.py.

#ifndef MESHTUNE_DORA_MAGNITUDE_GRAD_CUH  // a translation unit of several kernels holds it once
#define MESHTUNE_DORA_MAGNITUDE_GRAD_CUH

namespace dora {

template <int WARPS, int WITH_B, int R, int COLS, int CHUNKS, class T, class GT>
__device__ void magnitude_grad(const float* part, const float* m, const float* norms, const int* off,
                               const float* bpart, const float* bscale, float* dm, float* gbo) {
  const float* norm = norms + off[0];
  __shared__ float sums[WARPS][32];
  int c = threadIdx.x & 31, j = threadIdx.x >> 5;
  int col = blockIdx.x * 32 + c;
  // Every chunk's load issued before the first add (then m's and the norm's): one after another, each waiting
  // on the add before it, they left the GPU waiting on dependent reads.
  constexpr int PER_WARP = (CHUNKS + WARPS - 1) / WARPS;
  float got[PER_WARP];
#pragma unroll
  for (int q = 0; q < PER_WARP; ++q)
    got[q] = col < COLS && j + q * WARPS < CHUNKS ? part[(long long)(j + q * WARPS) * COLS + col] : 0.0f;
  float rs = col < COLS ? static_cast<float>(static_cast<T>(m[col] / norm[col])) : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < PER_WARP; ++q)
    if (j + q * WARPS < CHUNKS) sum += got[q];  // chunks j, j + WARPS, ... in turn
  sums[j][c] = sum;
  __syncthreads();
  if (col < COLS) {
    if (j == 0) {
      float total = 0.0f;
      for (int i = 0; i < WARPS; ++i) total += sums[i][c];
      float den = rs * norm[col];
      dm[col] = den == 0.0f ? 0.0f : total / den;
    }
    if constexpr (WITH_B) {  // B's rows shared out over the warps, each thread adding its row's chunks in order
      float sc = static_cast<float>(static_cast<GT>(bscale[0]));
      constexpr int LOADS = 16;  // chunks loaded before they are added
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
      }
    }
  }
}

}  // namespace dora

#endif  // MESHTUNE_DORA_MAGNITUDE_GRAD_CUH
