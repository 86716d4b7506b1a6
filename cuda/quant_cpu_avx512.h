// AVX-512 loops of Mesa's CPU kernels (included by quant_cpu.cpp only, after
// quant_cpu_avx2.h): quantize and per-group min/max, 16 lanes wide, on the per-element math of
// quant_math.h. Built where the CPU has AVX-512 F/BW/VL/DQ (mesa_ops.backend adds the flags and
// its own extension name); the AVX2 loops then take only the 16-element remainders.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

#include "quant_cpu_avx2.h"
#include "quant_math.h"

namespace mesa {
namespace {

// The same IEEE operations in the same order as quant_math.h and the AVX2 loops (sub, mul, add
// as separate instructions; max/min with the header's operand order): bit-identical results.
template <typename T>
struct Vec16 : std::false_type {};
template <>
struct Vec16<float> : std::true_type {
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
};
template <>
struct Vec16<c10::Half> : std::true_type {
  static __m512 load16(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct Vec16<c10::BFloat16> : std::true_type {
  static __m512 load16(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

inline __m512i hash32_avx512(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kHashMul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kHashMul2)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

inline __m512 normalize16_avx512(__m512 x, __m512 vm, __m512 vr) {
  return _mm512_mul_ps(_mm512_sub_ps(x, vm), vr);
}

// Codes of 16 values as 16 bytes (0 <= code <= 255 after the clamp: vpmovdb's truncation is exact).
inline __m128i quantize16_avx512(__m512 x, __m512 vsh, __m512 viv, __m512 u, __m512 vmax) {
  __m512 v = _mm512_mul_ps(_mm512_sub_ps(x, vsh), viv);
  v = _mm512_add_ps(v, u);
  v = _mm512_max_ps(v, _mm512_setzero_ps());  // v > 0 ? v : 0  (NaN -> 0)
  v = _mm512_min_ps(v, vmax);                 // v < maxq ? v : maxq
  return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v));
}

// The loop-invariant vectors of quantize_run_avx512 (built once per tile, as QuantConsts).
struct QuantConsts512 {
  __m512 vmax, scale;
  __m512i iota, sel_a, sel_b, lo16, k0;
  QuantConsts512(float maxq, uint64_t seed)
      : vmax(_mm512_set1_ps(maxq)), scale(_mm512_set1_ps(kNoiseScale)),
        iota(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        // block A's noise: the low halves of hashes 0-7, then their high halves; block B: 8-15
        sel_a(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)),
        sel_b(_mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)),
        lo16(_mm512_set1_epi32(0xffff)),
        k0(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed)))) {}
};

// Codes of elements [e, t) of one group, 32 at a time (two 16-element noise blocks from one
// 16-lane hash of pairs p .. p + 15), from e (a multiple of 16); returns where it stopped (the
// AVX2 loop takes a 16-element rest). Same arguments as quantize_run_avx2, plus the 16-lane
// constants k16.
template <bool NORM, typename T>
inline int64_t quantize_run_avx512(const T* xs, uint8_t* out, int64_t s, int64_t e, int64_t t,
                                   float iv, float sh, const QuantConsts& k,
                                   const QuantConsts512& k16, float mean, float rstd) {
  if constexpr (!Vec16<T>::value) {
    return e;
  } else {
    const __m512 viv = _mm512_set1_ps(iv), vsh = _mm512_set1_ps(sh);
    const __m512 vm = _mm512_set1_ps(mean), vr = _mm512_set1_ps(rstd);
    auto load = [&](const T* p) {
      const __m512 v = Vec16<T>::load16(p);
      return NORM ? normalize16_avx512(v, vm, vr) : v;
    };
    __m512 ua = _mm512_set1_ps(0.5f), ub = ua;
    for (; e + 32 <= t; e += 32) {
      if (k.stochastic) {
        const uint64_t p = static_cast<uint64_t>(e) >> 1;  // pair of element e (e % 16 == 0)
        const __m512i pl = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p))), k16.iota);
        const __m512i hk = _mm512_set1_epi32(static_cast<int>(
            (static_cast<uint32_t>(p >> 32) ^ static_cast<uint32_t>(k.seed >> 32)) * kGolden));
        const __m512i h = hash32_avx512(_mm512_add_epi32(_mm512_xor_si512(pl, k16.k0), hk));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(h, k16.lo16));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(h, 16));
        ua = _mm512_mul_ps(_mm512_permutex2var_ps(lo, k16.sel_a, hi), k16.scale);
        ub = _mm512_mul_ps(_mm512_permutex2var_ps(lo, k16.sel_b, hi), k16.scale);
      }
      const T* xp = xs + (e - s);
      uint8_t* op = out + (e - s);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(op), quantize16_avx512(load(xp), vsh, viv, ua, k16.vmax));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(op + 16),
                       quantize16_avx512(load(xp + 16), vsh, viv, ub, k16.vmax));
    }
    return e;
  }
}

// Min/max/non-finite of n values (n % 16 == 0) folded into the 8-lane accumulators of
// minmax_acc_avx2 (16-lane accumulators within the call, folded to 8 lanes at its end).
template <bool NORM, typename T>
inline void minmax_acc_avx512(const T* p, int64_t n, __m256* lo, __m256* hi, __m256i* bad,
                              float mean, float rstd) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  const __m512 vm = _mm512_set1_ps(mean), vr = _mm512_set1_ps(rstd);
  __m512 l = _mm512_castps256_ps512(*lo), h = _mm512_castps256_ps512(*hi);
  l = _mm512_insertf32x8(l, *lo, 1);
  h = _mm512_insertf32x8(h, *hi, 1);
  __mmask16 b = 0;
  for (int64_t i = 0; i < n; i += 16) {
    __m512 a = Vec16<T>::load16(p + i);
    if (NORM) a = normalize16_avx512(a, vm, vr);
    l = _mm512_min_ps(a, l);  // v < lo ? v : lo
    h = _mm512_max_ps(a, h);  // v > hi ? v : hi
    b |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), expo), expo);
  }
  *lo = _mm256_min_ps(_mm512_castps512_ps256(l), _mm512_extractf32x8_ps(l, 1));
  *hi = _mm256_max_ps(_mm512_castps512_ps256(h), _mm512_extractf32x8_ps(h, 1));
  if (b) *bad = _mm256_set1_epi32(-1);
}

}  // namespace
}  // namespace mesa
#define MESA_HAVE_AVX512 1
#endif
