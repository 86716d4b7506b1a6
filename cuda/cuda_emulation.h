// A small CUDA emulator for the host: quant_cuda.cu's kernels compiled by g++ and run on CPU
// tensors, so the tests check the very kernels the GPU runs, bit for bit, on a machine with no
// GPU (tests/test_cuda_emulation.py; built by quant_cuda_emu.cpp).
//
// A launch runs the grid one block at a time and each block's threads as fibers (ucontext) on
// the calling thread: a thread runs until it reaches __syncthreads() or returns, then the next
// thread of the block runs; a block's threads resume past the barrier once all of them reached
// it. So shared memory is the function's static storage (one block lives at a time), atomics
// are plain read-modify-writes and __threadfence is a no-op. A barrier that some threads of a
// block reach while others have returned is a divergent __syncthreads and fails the launch.
// Only what quant_cuda.cu uses is provided; warp-level intrinsics are deliberately absent. Wide
// accesses (quant_cuda_vec.cuh's vcopy) are counted, and a launch that made a misaligned one fails.
#pragma once
#include <ucontext.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;
// CUDA's 8- and 16-byte vector words (quant_cuda_vec.cuh's vcopy)
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

namespace mesa_emu {

struct State {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
  ucontext_t scheduler;
  ucontext_t* current = nullptr;
  const std::function<void()>* body = nullptr;
  bool* done = nullptr;
  bool force_index64 = false;  // run the 64-bit-index kernels at any size (tests)
  uint64_t launches = 0;       // kernel launches so far (tests count them per op)
  uint64_t vector_accesses = 0;  // wide loads/stores so far (quant_cuda_vec.cuh's vcopy)
  uint64_t misaligned = 0;       // of those, misaligned ones in the running launch (a GPU faults)
};

inline State& state() {
  static thread_local State s;
  return s;
}

inline void fiber_main() {
  State& s = state();
  bool* done = s.done;
  (*s.body)();
  *done = true;  // returning resumes uc_link, the scheduler
}

// Runs body() as every thread of every block of the grid (see the file comment).
inline void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
  constexpr size_t kStack = 256 * 1024;
  State& s = state();
  ++s.launches;
  const unsigned nthreads = block.x * block.y * block.z;
  TORCH_CHECK(nthreads > 0 && nthreads <= 1024, "cuda emulation: block of ", nthreads, " threads");
  std::vector<ucontext_t> ctx(nthreads);
  std::vector<std::unique_ptr<char[]>> stacks(nthreads);
  for (auto& st : stacks) st.reset(new char[kStack]);
  std::unique_ptr<bool[]> done(new bool[nthreads]);
  s.block_dim = block;
  s.grid_dim = grid;
  s.body = &body;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        s.block_idx = dim3(bx, by, bz);
        for (unsigned t = 0; t < nthreads; ++t) {
          done[t] = false;
          getcontext(&ctx[t]);
          ctx[t].uc_stack.ss_sp = stacks[t].get();
          ctx[t].uc_stack.ss_size = kStack;
          ctx[t].uc_link = &s.scheduler;
          makecontext(&ctx[t], fiber_main, 0);
        }
        unsigned alive = nthreads;
        while (alive > 0) {  // one round: every live thread runs to its next barrier or its end
          unsigned finished = 0;
          for (unsigned t = 0; t < nthreads; ++t) {
            if (done[t]) continue;
            s.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            s.current = &ctx[t];
            s.done = &done[t];
            swapcontext(&s.scheduler, &ctx[t]);
            if (done[t]) ++finished;
          }
          TORCH_CHECK(finished == 0 || finished == alive,
                      "cuda emulation: divergent __syncthreads (", alive - finished, " of ", alive,
                      " threads of block (", bx, ", ", by, ", ", bz, ") wait at a barrier the others "
                      "never reach)");
          alive -= finished;
        }
      }
  s.body = nullptr;
  const uint64_t bad = s.misaligned;
  s.misaligned = 0;
  TORCH_CHECK(bad == 0, "cuda emulation: ", bad, " misaligned vector access(es) in one launch (a "
              "GPU faults on these)");
}

inline void syncthreads() {
  State& s = state();
  swapcontext(s.current, &s.scheduler);
}

}  // namespace mesa_emu

#define threadIdx (mesa_emu::state().thread_idx)
#define blockIdx (mesa_emu::state().block_idx)
#define blockDim (mesa_emu::state().block_dim)
#define gridDim (mesa_emu::state().grid_dim)

inline void __syncthreads() { mesa_emu::syncthreads(); }
inline void __threadfence() {}

template <typename T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
