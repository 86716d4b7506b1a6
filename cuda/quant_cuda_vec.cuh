// Device helpers of quant_cuda.cu's vectorised kernels: the one wide load/store (vcopy), the
// alignment test that picks it, the cursor that steps an element's group (and row) along a
// run of consecutive elements without a division per element, and the restore loop over runs
// that the dequantize and table kernels share (restore_runs).
//
// Every wide access of the kernels goes through vcopy<B> (B = 2, 4, 8 or 16 bytes, one native
// access: uint16_t, uint32_t, uint2, uint4). A GPU faults on a misaligned vector access where x86
// does not, so under MESA_CUDA_EMULATION vcopy checks that both sides are B-aligned and counts
// the accesses (mesa_emu::state(): vector_accesses, misaligned); mesa_emu::launch fails a launch
// that made a misaligned one, so every emulation test would catch it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MESA_UNROLL _Pragma("unroll")
#else
#define MESA_UNROLL
#endif

namespace mesa {
namespace {

template <int B>
struct WordOf;
template <>
struct WordOf<2> { using type = uint16_t; };
template <>
struct WordOf<4> { using type = uint32_t; };
template <>
struct WordOf<8> { using type = uint2; };
template <>
struct WordOf<16> { using type = uint4; };

template <int B>
__device__ __forceinline__ bool aligned_to(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & static_cast<uintptr_t>(B - 1)) == 0;
}

// B bytes from src to dst as one access of a B-byte word: both must be B-aligned (one side is a
// local array declared alignas(16), the other global memory the caller tested with aligned_to).
template <int B>
__device__ __forceinline__ void vcopy(void* dst, const void* src) {
  using W = typename WordOf<B>::type;
#if defined(MESA_CUDA_EMULATION)
  mesa_emu::State& s = mesa_emu::state();
  ++s.vector_accesses;
  if (!aligned_to<B>(dst) || !aligned_to<B>(src)) ++s.misaligned;
  std::memcpy(dst, src, sizeof(W));
#else
  *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
#endif
}

// The widest access a run of BYTES bytes is copied with (its alignment): at most 16 bytes.
template <int BYTES>
struct RunWidth {
  static constexpr int value = BYTES < 16 ? BYTES : 16;
};

// A run of BYTES bytes (a power of two, 2 or more) in accesses of RunWidth<BYTES> bytes.
template <int BYTES>
__device__ __forceinline__ void vcopy_run(void* dst, const void* src) {
  constexpr int B = RunWidth<BYTES>::value;
  MESA_UNROLL
  for (int i = 0; i < BYTES / B; ++i)
    vcopy<B>(static_cast<char*>(dst) + i * B, static_cast<const char*>(src) + i * B);
}

// Whether n elements of T at p can be copied by vcopy_run (n * sizeof(T) bytes).
template <typename T, int N>
__device__ __forceinline__ bool run_aligned(const T* p) {
  return aligned_to<RunWidth<N * static_cast<int>(sizeof(T))>::value>(p);
}

// Position of element e in a tensor viewed as (outer, G, inner): the group g = (e / inner) % G
// and r = e % inner, set by one division and stepped element by element.
template <typename I>
struct GroupCursor {
  I g, r, inner, G;
  __device__ __forceinline__ GroupCursor(I e, I inner_, I G_) : inner(inner_), G(G_) {
    const I q = e / inner;
    r = e - q * inner;
    g = q % G;
  }
  __device__ __forceinline__ void next() {
    if (++r == inner) {
      r = 0;
      if (++g == G) g = 0;
    }
  }
};

// Row q and column c of element e in rows of len elements, stepped element by element.
template <typename I>
struct RowCursor {
  I q, c, len;
  __device__ __forceinline__ RowCursor(I e, I len_) : len(len_) {
    q = e / len;
    c = e - q * len;
  }
  __device__ __forceinline__ void next() {
    if (++c == len) {
      c = 0;
      ++q;
    }
  }
};

// ---- the kernels' element access -----------------------------------------------------------
constexpr int kMinmaxRun = 8;   // elements a thread of minmax_kernel reads at a time
constexpr int kQuantRun = 16;   // elements a thread of quantize_kernel packs at a time
constexpr int kRestoreRun = 8;  // elements a thread of dequantize_kernel / lut_kernel restores

// Element e of x in logical order (see row_layout): p[e] for a contiguous x, else
// p[(e / len) * stride + e % len].
template <typename T, typename I>
struct DRows {
  const T* __restrict__ p;
  I len, stride;
  __device__ __forceinline__ T raw(I e) const {
    return len == stride ? p[e] : p[(e / len) * stride + e % len];
  }
  __device__ __forceinline__ float at(I e) const { return static_cast<float>(raw(e)); }
};

// A LayerNorm's statistics, one per row of rn_len elements (norm == false: none).
struct DNorm {
  const float* __restrict__ mean;
  const float* __restrict__ rstd;
  int64_t len;
};

template <typename T, typename I, bool NORM>
__device__ __forceinline__ float load(const DRows<T, I>& x, const DNorm& rn, I e) {
  const float v = x.at(e);
  if (!NORM) return v;
  const I r = e / static_cast<I>(rn.len);
  return normalize_one(v, rn.mean[r], rn.rstd[r]);
}

__device__ __forceinline__ bool nonfinite(float v) {
  uint32_t b;
  memcpy(&b, &v, sizeof(b));
  return nonfinite_bits(b);
}

// Every thread of the block passes its (lo, hi, non-finite flag); the block's min, max and
// flag end up in s_lo[0], s_hi[0], s_bad[0] (a tree in shared memory; all threads must call).
__device__ __forceinline__ void block_minmax(float lo, float hi, int bad, float* s_lo, float* s_hi,
                                             int* s_bad) {
  const unsigned tid = threadIdx.x;
  s_lo[tid] = lo;
  s_hi[tid] = hi;
  s_bad[tid] = bad;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (tid < half) {
      s_lo[tid] = s_lo[tid + half] < s_lo[tid] ? s_lo[tid + half] : s_lo[tid];
      s_hi[tid] = s_hi[tid + half] > s_hi[tid] ? s_hi[tid + half] : s_hi[tid];
      s_bad[tid] |= s_bad[tid + half];
    }
    __syncthreads();
  }
}

// The 2 * bits bytes of a full run of kQuantRun codes as one store, when o is aligned to them.
__device__ __forceinline__ bool store_codes(uint8_t* o, const uint64_t* w, int bits) {
  switch (bits) {
    case 8: return aligned_to<16>(o) ? (vcopy<16>(o, w), true) : false;
    case 4: return aligned_to<8>(o) ? (vcopy<8>(o, w), true) : false;
    case 2: return aligned_to<4>(o) ? (vcopy<4>(o, w), true) : false;
    default: return aligned_to<2>(o) ? (vcopy<2>(o, w), true) : false;
  }
}

// The codes of run k of kRestoreRun elements (the bits bytes from byte k * bits; element i at
// bit i * bits), cnt of them: one load of 8/4/2 bytes where whole and aligned.
template <typename I>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* __restrict__ in, I k, int cnt,
                                               int bits) {
  const uint8_t* p = in + k * static_cast<I>(bits);
  alignas(16) uint64_t c = 0;
  if (cnt == kRestoreRun) {
    switch (bits) {
      case 8: if (aligned_to<8>(p)) { vcopy<8>(&c, p); return c; } break;
      case 4: if (aligned_to<4>(p)) { vcopy<4>(&c, p); return c; } break;
      case 2: if (aligned_to<2>(p)) { vcopy<2>(&c, p); return c; } break;
      default: break;
    }
  }
  const int nb = (cnt * bits + 7) / 8;
  for (int b = 0; b < nb; ++b) c |= static_cast<uint64_t>(p[b]) << (8 * b);
  return c;
}

// Element e of the head (hd) when it lies in the exact prefix rows: *v its value.
template <typename T, typename I>
__device__ __forceinline__ bool head_value(const HeadRows& hd, I e, T* v) {
  I h;
  if (hd.p == nullptr || !head_index<I>(e, static_cast<I>(hd.C), static_cast<I>(hd.N),
                                        static_cast<I>(hd.P), &h))
    return false;
  *v = static_cast<const T*>(hd.p)[h];
  return true;
}

// out[e0, e0 + cnt) = v[0, cnt): one run of wide stores where whole and aligned.
template <typename T, typename I>
__device__ __forceinline__ void store_run(T* __restrict__ out, I e0, int cnt, const T* v) {
  constexpr int R = kRestoreRun;
  if (cnt == R && run_aligned<T, R>(out + e0)) {
    vcopy_run<R * sizeof(T)>(out + e0, v);
    return;
  }
  MESA_UNROLL
  for (int i = 0; i < R; ++i) {
    if (i >= cnt) break;
    out[e0 + i] = v[i];
  }
}

// A thread restores runs of kRestoreRun elements: their codes in one load, the values in wide
// stores (store_run), the group stepped along the run; the head's rows (hd) as they are. `run`
// gives the values: run.begin(e0, cnt) once per run (its preloads), run.value(e0, i, code, g)
// the value of element e0 + i, of group g. One loop for dequantize_kernel and lut_kernel.
template <typename T, typename I, typename Run>
__device__ __forceinline__ void restore_runs(const uint8_t* __restrict__ in, T* __restrict__ out,
                                             I n, int bits, I inner, I G, const HeadRows& hd,
                                             Run& run) {
  constexpr int R = kRestoreRun;
  const uint32_t mask = (1u << bits) - 1u;
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  const I runs = (n + R - 1) / R;
  for (I k = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; k < runs; k += stride) {
    const I e0 = k * R;
    const int cnt = static_cast<int>(std::min<I>(R, n - e0));
    const uint64_t c = load_codes(in, k, cnt, bits);
    run.begin(e0, cnt);
    GroupCursor<I> gc(e0, inner, G);
    alignas(16) T v[R];
    MESA_UNROLL
    for (int i = 0; i < R; ++i, gc.next()) {
      if (i >= cnt) break;
      if (head_value<T, I>(hd, e0 + i, v + i)) continue;
      v[i] = run.value(e0, i, static_cast<uint32_t>(c >> (i * bits)) & mask, gc.g);
    }
    store_run(out, e0, cnt, v);
  }
}

}  // namespace
}  // namespace mesa
