// A small CUDA emulator for the host: quant_cuda.cu's kernels compiled by g++ and run on CPU
// tensors, so the tests check the very kernels the GPU runs, bit for bit, on a machine with no
// GPU (tests/test_cuda_emulation.py; built by quant_cuda_emu.cpp).
//
// A launch runs the grid one block at a time and each block's threads as fibers (ucontext) on
// the calling thread: a thread runs until it reaches __syncthreads() or returns, then the next
// thread of the block runs; a block's threads resume past the barrier once all of them reached
// it. So shared memory is the function's static storage (one block lives at a time), atomics
// are plain read-modify-writes and __threadfence is a no-op. A cooperative launch
// (launch_cooperative, for cooperative_groups::this_grid().sync()) keeps every thread of the
// grid as a fiber, and between two grid syncs runs the blocks one at a time, each to the grid
// sync: a kernel must keep no shared-memory value across a grid sync (one block's shared memory
// is the next block's storage too). A barrier that some threads of a
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
  bool at_grid_sync = false;   // the fiber that last yielded waits at a grid sync (else __syncthreads)
  bool force_index64 = false;  // run the 64-bit-index kernels at any size (tests)
  int coop_blocks = 3;         // blocks a cooperative launch may have (0: none; tests)
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
            s.at_grid_sync = false;
            swapcontext(&s.scheduler, &ctx[t]);
            TORCH_CHECK(!s.at_grid_sync, "cuda emulation: a grid sync in a launch that is not "
                        "cooperative");
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
  s.at_grid_sync = false;
  swapcontext(s.current, &s.scheduler);
}

inline void grid_sync() {
  State& s = state();
  s.at_grid_sync = true;
  swapcontext(s.current, &s.scheduler);
}

// A cooperative launch: body() as every thread of every block, all of them fibers at once (see
// the file comment). Between grid syncs each block runs alone (in turn, the order reversed
// after each grid sync: a read of another block's write that a missing grid sync would race
// reads the value before the write in one of the two orders), its threads in rounds to their
// next __syncthreads, until every one of them waits at the grid sync or has returned; the grid
// goes on once every thread of every block waits there. A block some of whose threads return
// while others wait, or a grid sync that only some blocks reach, fails the launch (a GPU hangs).
inline void launch_cooperative(dim3 grid, dim3 block, const std::function<void()>& body) {
  constexpr size_t kStack = 128 * 1024;
  State& s = state();
  ++s.launches;
  const unsigned nthreads = block.x * block.y * block.z;
  const unsigned nblocks = grid.x * grid.y * grid.z;
  TORCH_CHECK(nthreads > 0 && nthreads <= 1024, "cuda emulation: block of ", nthreads, " threads");
  TORCH_CHECK(nblocks > 0 && static_cast<int>(nblocks) <= s.coop_blocks, "cuda emulation: a "
              "cooperative grid of ", nblocks, " blocks (at most ", s.coop_blocks, " fit)");
  const size_t total = static_cast<size_t>(nthreads) * nblocks;
  std::vector<ucontext_t> ctx(total);
  std::vector<std::unique_ptr<char[]>> stacks(total);
  std::unique_ptr<bool[]> done(new bool[total]());
  std::unique_ptr<bool[]> waiting(new bool[total]());  // at the grid sync
  s.block_dim = block;
  s.grid_dim = grid;
  s.body = &body;
  for (size_t f = 0; f < total; ++f) {
    stacks[f].reset(new char[kStack]);
    getcontext(&ctx[f]);
    ctx[f].uc_stack.ss_sp = stacks[f].get();
    ctx[f].uc_stack.ss_size = kStack;
    ctx[f].uc_link = &s.scheduler;
    makecontext(&ctx[f], fiber_main, 0);
  }
  for (unsigned phase = 0;; ++phase) {
    unsigned blocks_done = 0;
    // blocks in ascending order in even phases, descending in odd ones: what block 0 writes
    // before a grid sync is read by the others only after it, whatever side of it they run
    for (unsigned i = 0; i < nblocks; ++i) {
      const unsigned b = phase % 2 == 0 ? i : nblocks - 1 - i;
      s.block_idx = dim3(b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y));
      const size_t first = static_cast<size_t>(b) * nthreads;
      for (;;) {  // rounds: every running thread of the block to its next barrier or its end
        unsigned ran = 0, finished = 0, at_grid = 0;
        for (unsigned t = 0; t < nthreads; ++t) {
          const size_t f = first + t;
          if (done[f] || waiting[f]) continue;
          s.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          s.current = &ctx[f];
          s.done = &done[f];
          s.at_grid_sync = false;
          swapcontext(&s.scheduler, &ctx[f]);
          ++ran;
          if (done[f]) {
            ++finished;
          } else if (s.at_grid_sync) {
            waiting[f] = true;
            ++at_grid;
          }
        }
        if (ran == 0) break;
        TORCH_CHECK(finished + at_grid == 0 || finished + at_grid == ran,
                    "cuda emulation: divergent __syncthreads in block ", b, " of a cooperative launch");
      }
      unsigned n_done = 0;
      for (unsigned t = 0; t < nthreads; ++t) n_done += done[first + t] ? 1 : 0;
      TORCH_CHECK(n_done == 0 || n_done == nthreads, "cuda emulation: ", nthreads - n_done, " of ",
                  nthreads, " threads of block ", b, " wait at a grid sync the others never reach");
      blocks_done += n_done == nthreads ? 1 : 0;
    }
    if (blocks_done == nblocks) break;
    TORCH_CHECK(blocks_done == 0, "cuda emulation: ", nblocks - blocks_done, " of ", nblocks,
                " blocks wait at a grid sync the others never reach");
    for (size_t f = 0; f < total; ++f) waiting[f] = false;  // every thread is there: go on
  }
  s.body = nullptr;
  const uint64_t bad = s.misaligned;
  s.misaligned = 0;
  TORCH_CHECK(bad == 0, "cuda emulation: ", bad, " misaligned vector access(es) in one launch (a "
              "GPU faults on these)");
}

}  // namespace mesa_emu

#define threadIdx (mesa_emu::state().thread_idx)
#define blockIdx (mesa_emu::state().block_idx)
#define blockDim (mesa_emu::state().block_dim)
#define gridDim (mesa_emu::state().grid_dim)

inline void __syncthreads() { mesa_emu::syncthreads(); }

namespace cooperative_groups {
struct grid_group {
  void sync() const { mesa_emu::grid_sync(); }
};
inline grid_group this_grid() { return grid_group{}; }
}  // namespace cooperative_groups
inline void __threadfence() {}

template <typename T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
