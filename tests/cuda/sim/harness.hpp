// Runs a CUDA kernel on the CPU: a fiber per CUDA thread, all on one OS thread, blocks one after another,
// __syncthreads as a barrier of the block's fibers, __shfl_xor_sync through a per-warp exchange buffer and a
// barrier of the warp's 32; `__device__` functions are plain ones. `__shared__` arrays become function
// statics, shared by the block's fibers. A fiber runs until it reaches a barrier, then the next runnable one
// does; a barrier's waiters run again once all its fibers have arrived. A fiber starts on its own stack
// through ucontext; switches are _setjmp/_longjmp, which, unlike swapcontext, make no system call. Enough for
// meshtune's kernels (tests/cuda/cuda_sim.py); float stands in for every floating element type.
#undef _FORTIFY_SOURCE  // its longjmp check rejects a jump to another fiber's stack
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext calls only then
#endif
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

using std::max;
using std::min;
struct Dim3 { unsigned x, y, z; };
Dim3 threadIdx, blockIdx;  // the running fiber's, set on each switch
Dim3 blockDim, gridDim;
int sim_lane, sim_warp;
#define __shared__ static
float sim_exchange[32][32];

struct SimBarrier {
  int size = 0, arrived = 0;
  std::vector<int> waiting;
};
struct SimFiber {
  ucontext_t context;
  jmp_buf resume;
  std::unique_ptr<char[]> stack;  // not zeroed: a page is touched only if the fiber's stack reaches it
  Dim3 block;
  bool started = false, done = false, waiting = false;
};
std::vector<SimFiber> sim_fibers;
SimBarrier sim_block_barrier, sim_warp_barrier[32];
jmp_buf sim_scheduler;
int sim_current = -1;

inline void sim_arrive(SimBarrier& b) {
  SimFiber& me = sim_fibers[sim_current];
  if (++b.arrived == b.size) {  // the last to arrive releases the others and goes on
    for (int f : b.waiting) sim_fibers[f].waiting = false;
    b.waiting.clear();
    b.arrived = 0;
    return;
  }
  b.waiting.push_back(sim_current);
  me.block = blockIdx;
  me.waiting = true;
  if (!_setjmp(me.resume)) _longjmp(sim_scheduler, 1);
}
inline void __syncthreads() { sim_arrive(sim_block_barrier); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  sim_exchange[sim_warp][sim_lane] = v;
  sim_arrive(sim_warp_barrier[sim_warp]);
  float r = sim_exchange[sim_warp][sim_lane ^ offset];
  sim_arrive(sim_warp_barrier[sim_warp]);
  return r;
}
inline float fmaxf(float a, float b) { return a > b ? a : b; }
// Blocks run one after another here, so a fence has nothing to order and an atomic nothing to race.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned old = *p; *p += v; return old; }
inline float __ldcg(const float* p) { return *p; }
#define __device__
#define __forceinline__ inline
struct alignas(16) float4 { float x, y, z, w; };

// grid and block as mx.fast.cuda_kernel takes them: grid in threads, x and y. A block's fibers are made
// once and take the blocks in turn, each block ended by a barrier of them all, so blocks run one after another.
template <class F>
struct SimBody {
  static F* body;
  static void run() {
    for (unsigned by = 0; by < gridDim.y; ++by)
      for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        blockIdx = {bx, by, 0};
        (*body)();
        sim_arrive(sim_block_barrier);
      }
    sim_fibers[sim_current].done = true;
    _longjmp(sim_scheduler, 1);  // never returns: the fiber's stack is left as it is
  }
};
template <class F>
F* SimBody<F>::body = nullptr;

template <class F>
void sim_launch(int grid_x, int grid_y, int block_x, F body) {
  blockDim = {(unsigned)block_x, 1, 1};
  gridDim = {(unsigned)((grid_x + block_x - 1) / block_x), (unsigned)grid_y, 1};
  sim_block_barrier.size = block_x;
  for (int w = 0; w < 32; ++w) sim_warp_barrier[w].size = 32;
  SimBody<F>::body = &body;
  sim_fibers = std::vector<SimFiber>(block_x);
  for (int t = 0; t < block_x; ++t) {
    SimFiber& f = sim_fibers[t];
    f.stack.reset(new char[1 << 17]);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = 1 << 17;
    f.context.uc_link = nullptr;
    makecontext(&f.context, SimBody<F>::run, 0);
  }
  for (bool left = true; left;) {
    left = false;
    bool ran = false;
    for (int t = 0; t < block_x; ++t) {
      SimFiber& f = sim_fibers[t];
      if (f.done) continue;
      left = true;
      if (f.waiting) continue;
      sim_current = t;
      threadIdx = {(unsigned)t, 0, 0};
      blockIdx = f.block;
      sim_lane = t & 31;
      sim_warp = t >> 5;
      if (!_setjmp(sim_scheduler)) {
        if (f.started) _longjmp(f.resume, 1);
        f.started = true;
        setcontext(&f.context);
      }
      ran = true;
    }
    if (left && !ran) { fprintf(stderr, "simulated kernel: every thread waits at a barrier (deadlock)\n"); exit(3); }
  }
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
