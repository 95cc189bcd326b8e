// Runs a CUDA kernel body on the CPU: a thread per CUDA thread, blocks one after another,
// __syncthreads as a barrier of the block's threads, __shfl_xor_sync through a per-warp
// exchange buffer. `__shared__` arrays become function statics, shared by the block's threads.
// Enough for meshtune's kernels (tests/test_kernels_simulated.py); float stands in for T.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

using std::max;
using std::min;
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
thread_local int sim_lane, sim_warp;
#define __shared__ static
std::barrier<>* sim_block_barrier;
std::barrier<>* sim_warp_barrier[32];
float sim_exchange[32][32];
inline void __syncthreads() { sim_block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  sim_exchange[sim_warp][sim_lane] = v;
  sim_warp_barrier[sim_warp]->arrive_and_wait();
  float r = sim_exchange[sim_warp][sim_lane ^ offset];
  sim_warp_barrier[sim_warp]->arrive_and_wait();
  return r;
}
inline float fmaxf(float a, float b) { return a > b ? a : b; }
// Blocks run one after another here, so a fence has nothing to order and an atomic nothing to race.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned old = *p; *p += v; return old; }
inline float __ldcg(const float* p) { return *p; }
typedef float T;
struct alignas(16) float4 { float x, y, z, w; };

// grid and block as mx.fast.cuda_kernel takes them: grid in threads, x and y. A block's threads are made
// once and take the blocks in turn, all of them done with one block before any starts the next (a barrier),
// so blocks still run one after another; making threads a block spent most of the time in the kernel.
template <class F>
void sim_launch(int grid_x, int grid_y, int block_x, F body) {
  blockDim = {(unsigned)block_x, 1, 1};
  gridDim = {(unsigned)((grid_x + block_x - 1) / block_x), (unsigned)grid_y, 1};
  std::barrier<> block(block_x);
  sim_block_barrier = &block;
  for (int w = 0; w < block_x / 32; ++w) sim_warp_barrier[w] = new std::barrier<>(32);
  std::vector<std::thread> threads;
  for (int t = 0; t < block_x; ++t)
    threads.emplace_back([=, &block] {
      threadIdx = {(unsigned)t, 0, 0};
      sim_lane = t & 31;
      sim_warp = t >> 5;
      for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned bx = 0; bx < gridDim.x; ++bx) {
          blockIdx = {bx, by, 0};
          body();
          block.arrive_and_wait();
        }
    });
  for (auto& th : threads) th.join();
  for (int w = 0; w < block_x / 32; ++w) delete sim_warp_barrier[w];
}

template <class V>
std::vector<V> sim_read(const char* path, size_t n) {
  std::vector<V> v(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(V), n, f) != n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
  fclose(f);
  return v;
}

void sim_write(const char* path, const std::vector<float>& v) {
  FILE* f = fopen(path, "wb");
  fwrite(v.data(), sizeof(float), v.size(), f);
  fclose(f);
}
