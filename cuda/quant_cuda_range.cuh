// The range pass of quant_cuda.cu as block-level device functions, shared by its two ways of
// running it: minmax_kernel (a grid of (chunks, G) blocks; the last block to finish finalizes)
// and quantize_step_kernel (one cooperative launch: each block takes chunks in turn, a grid-wide
// sync, block 0 finalizes, a grid-wide sync, then the codes).
//
//   minmax_chunk     per-group min/max/non-finite partials of chunk c of group g of a
//                    (outer, G, inner) tensor: one block-level reduction, written by thread 0
//   finalize_ranges  the partials of every chunk reduced per group (few groups: each group's
//                    chunks by the whole block; many: a thread per group), then finalized: the
//                    (2, G) min/max, or the running-range update of (clip_val, shift, iteration)
//                    with the (4, G) rows it quantizes with (quant_math.h's finalize_group, as the
//                    CPU kernel)
//
// `part` (3, G, chunks): partial lo, hi, non-finite (1/0) of each chunk of each group. No shared
// memory value is live across a call (the cooperative kernel syncs the grid between them, and
// the emulation runs one block at a time between grid syncs).
#pragma once
#include <limits>

namespace mesa {
namespace {

// What finalize_ranges does with the per-group min/max.
struct Finalize {
  int op;  // kMinMax: (2, G) min/max into mm; kRange: the range update and its (4, G) rows
  float* mm;
  float* clip;
  float* shift;
  float* iteration;
  float* rows;
  float decay, one_minus_decay, levels;
  int mode;
  bool update, mark_nonfinite;
};
constexpr int kMinMax = 0;
constexpr int kRange = 1;

// Chunk c (elements [c * chunk, (c + 1) * chunk) of the group's per_group) of group g: its lo,
// hi and flag into part (thread 0). Every thread of the block must call; s_* are kThreads long.
template <typename T, typename I, bool NORM>
__device__ __forceinline__ void minmax_chunk(const DRows<T, I>& x, const DNorm& rn, I G, I inner,
                                             I per_group, I chunk, I c, I g, I chunks,
                                             float* part, float* s_lo, float* s_hi, int* s_bad) {
  const unsigned tid = threadIdx.x;
  const float inf = std::numeric_limits<float>::infinity();
  float lo = inf, hi = -inf;
  int bad = 0;
  // runs of kMinmaxRun consecutive j of the group (j = o * inner + r: element (o * G + g) *
  // inner + r); a run inside one row of `inner` of a contiguous x is one wide load
  constexpr int R = kMinmaxRun;
  const I begin = c * chunk;
  const I end = std::min<I>(per_group, begin + chunk);
  for (I j = begin + tid * R; j < end; j += blockDim.x * R) {
    const I cnt = std::min<I>(R, end - j);
    const I o = j / inner;
    I r = j - o * inner;
    I e = (o * G + g) * inner + r;
    alignas(16) T buf[R];
    if (!NORM && cnt == R && r + R <= inner && x.len == x.stride && run_aligned<T, R>(x.p + e)) {
      vcopy_run<R * sizeof(T)>(buf, x.p + e);
      MESA_UNROLL
      for (int i = 0; i < R; ++i) {
        const float v = static_cast<float>(buf[i]);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        bad |= nonfinite(v) ? 1 : 0;
      }
      continue;
    }
    for (I i = 0; i < cnt; ++i) {
      const float v = load<T, I, NORM>(x, rn, e);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      bad |= nonfinite(v) ? 1 : 0;
      ++e;
      if (++r == inner) {  // the next row of the group: G * inner elements on
        r = 0;
        e += (G - 1) * inner;
      }
    }
  }
  block_minmax(lo, hi, bad, s_lo, s_hi, s_bad);
  if (tid == 0) {
    part[(0 * G + g) * chunks + c] = s_lo[0];
    part[(1 * G + g) * chunks + c] = s_hi[0];
    part[(2 * G + g) * chunks + c] = static_cast<float>(s_bad[0]);
  }
}

// One block reduces every group's chunks and finalizes as `fin` says. Every thread of the block
// must call; s_* are kThreads long.
template <typename I>
__device__ __forceinline__ void finalize_ranges(float* part, I G, I chunks, const Finalize& fin,
                                                float* s_lo, float* s_hi, int* s_bad) {
  __shared__ int s_any_bad;
  __shared__ float s_iteration;
  const unsigned tid = threadIdx.x;
  const float inf = std::numeric_limits<float>::infinity();
  if (tid == 0) {
    s_any_bad = 0;
    s_iteration = fin.op == kRange ? fin.iteration[0] : 0.0f;
  }
  __syncthreads();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (G * 4 >= static_cast<I>(blockDim.x) || chunks <= 4) {
    // many groups or few chunks: one thread per group walks its chunks
    for (I q = tid; q < G; q += blockDim.x) {
      float l = inf, h = -inf, b = 0.0f;
      for (I c = 0; c < chunks; ++c) {
        const float pl = part[(0 * G + q) * chunks + c], ph = part[(1 * G + q) * chunks + c];
        l = pl < l ? pl : l;
        h = ph > h ? ph : h;
        b = part[(2 * G + q) * chunks + c] > b ? 1.0f : b;
      }
      const bool f = b == 0.0f && finite_range(l, h);
      part[(0 * G + q) * chunks] = f ? l : nan;
      part[(1 * G + q) * chunks] = f ? h : nan;
      if (!f) s_any_bad = 1;  // (every writer writes 1)
    }
  } else {
    // few groups, many chunks (G = 1: up to 2048 chunks): each group's chunks reduced by the
    // whole block, strided loads then a tree in shared memory, instead of one thread walking
    // them all while the others wait (min, max and the flag do not depend on the order)
    for (I q = 0; q < G; ++q) {
      float l = inf, h = -inf;
      int b = 0;
      for (I c = tid; c < chunks; c += blockDim.x) {
        const float pl = part[(0 * G + q) * chunks + c], ph = part[(1 * G + q) * chunks + c];
        l = pl < l ? pl : l;
        h = ph > h ? ph : h;
        b |= part[(2 * G + q) * chunks + c] != 0.0f ? 1 : 0;
      }
      block_minmax(l, h, b, s_lo, s_hi, s_bad);
      if (tid == 0) {
        const bool f = s_bad[0] == 0 && finite_range(s_lo[0], s_hi[0]);
        part[(0 * G + q) * chunks] = f ? s_lo[0] : nan;
        part[(1 * G + q) * chunks] = f ? s_hi[0] : nan;
        if (!f) s_any_bad = 1;
      }
      __syncthreads();  // (s_lo / s_hi / s_bad are the next group's)
    }
  }
  __syncthreads();
  const bool ok = s_any_bad == 0 && fin.update;
  const bool take = fin.mode == kRangeBatch || s_iteration == 0.0f;
  for (I q = tid; q < G; q += blockDim.x) {
    const float l = part[(0 * G + q) * chunks], h = part[(1 * G + q) * chunks];
    if (fin.op == kMinMax) {
      fin.mm[q] = l;
      fin.mm[G + q] = h;
      continue;
    }
    const bool f = l == l;  // not NaN
    finalize_group(l, h, ok, take, fin.decay, fin.one_minus_decay, fin.mode, fin.levels,
                   fin.clip + q, fin.shift + q, fin.rows + q, static_cast<int64_t>(G));
    fin.rows[3 * G + q] = f ? 1.0f : 0.0f;
    if (!f && fin.mark_nonfinite) fin.rows[2 * G + q] = nan;
  }
  if (tid == 0 && fin.op == kRange && ok) fin.iteration[0] = fadd(s_iteration, 1.0f);
}

}  // namespace
}  // namespace mesa
