// A gradient bucket's arrays packed into one flat array: out = concatenate of the arrays flattened and cast to T.
// Loaded by meshtune/parallel/pack_kernel.py (pack_cuda), whose switch on blockIdx.y hands array k here.
//
// Inputs: array k (any dtype S, flattened), offs (arrays + 1) int64: array k's first element in out.
// Outputs: out (offs[arrays]) in T.
// Launch: grid blocks x arrays, 256 threads a block: block row k copies array k by a grid-stride loop.
// Checked by tests/cuda/test_sim_pack.py (simulated), tests/cuda/test_pack_kernel.py (GPU), test_kernels_nvcc.py.

#ifndef MESHTUNE_PACK_KERNEL_CUH  // a translation unit of several kernels holds it once
#define MESHTUNE_PACK_KERNEL_CUH

namespace pack {

template <class T, class S, class O>
__device__ void copy_array(const S* in, const O* offs, T* out) {
  int k = blockIdx.y;
  long long start = offs[k];
  long long count = offs[k + 1] - start;
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
    out[start + i] = static_cast<T>(in[i]);
}

}  // namespace pack

#endif  // MESHTUNE_PACK_KERNEL_CUH
