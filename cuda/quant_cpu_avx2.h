// AVX2 loops of Mesa's CPU kernels (included by quant_cpu.cpp only): quantize, per-group
// min/max and the table lookup, on the per-element math of quant_math.h.
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#include "quant_math.h"

namespace mesa {
namespace {

// AVX2 versions of the loops: the same IEEE operations in the same order as quant_math.h
// (sub, mul, add as separate instructions; max/min with the header's operand order), so the
// results are bit-identical to the scalar code and the reference (the tests check this).
// fp16 and bf16 inputs are widened to fp32 exactly (F16C / a 16-bit shift) and take the same
// loops.
template <typename T>
struct Vec : std::false_type {};
template <>
struct Vec<float> : std::true_type {
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Vec<c10::Half> : std::true_type {
  static __m256 load8(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
template <>
struct Vec<c10::BFloat16> : std::true_type {
  static __m256 load8(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

inline __m256i hash32_avx2(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHashMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHashMul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

// Byte 0 of each 32-bit lane of a and b -> 16 bytes at out (a's 8 first).
inline void store_low_bytes16(__m256i a, __m256i b, uint8_t* out) {
  const __m256i ab = _mm256_packus_epi32(a, b);        // 16-bit: a0-3 b0-3 | a4-7 b4-7
  const __m256i w = _mm256_permute4x64_epi64(ab, 0xd8);  // a0-3 a4-7 | b0-3 b4-7
  const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
}

// normalize_one of 8 values: (x - mean) * rstd.
inline __m256 normalize8_avx2(__m256 x, __m256 vm, __m256 vr) {
  return _mm256_mul_ps(_mm256_sub_ps(x, vm), vr);
}

inline __m256i quantize8_avx2(__m256 x, __m256 vsh, __m256 viv, __m256 u, __m256 vmax) {
  __m256 v = _mm256_mul_ps(_mm256_sub_ps(x, vsh), viv);
  v = _mm256_add_ps(v, u);
  v = _mm256_max_ps(v, _mm256_setzero_ps());  // v > 0 ? v : 0  (NaN -> 0)
  v = _mm256_min_ps(v, vmax);                 // v < maxq ? v : maxq
  return _mm256_cvttps_epi32(v);
}

// The loop-invariant vectors of quantize_run_avx2 (built once per tile, not once per run).
struct QuantConsts {
  __m256 vmax, scale;
  __m256i k0, iota, lo16;
  uint64_t seed;
  bool stochastic;
  QuantConsts(float maxq, uint64_t sd, bool st)
      : vmax(_mm256_set1_ps(maxq)), scale(_mm256_set1_ps(kNoiseScale)),
        k0(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(sd)))),
        iota(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), lo16(_mm256_set1_epi32(0xffff)), seed(sd),
        stochastic(st) {}
};

// Codes of elements [e, t) of one group (global indices; xs/out point at element s), 16 at a
// time from e (a multiple of 16); returns where it stopped.
template <bool NORM, typename T>
inline int64_t quantize_run_avx2(const T* xs, uint8_t* out, int64_t s, int64_t e, int64_t t,
                                 float iv, float sh, const QuantConsts& k, float mean, float rstd) {
  const __m256 viv = _mm256_set1_ps(iv), vsh = _mm256_set1_ps(sh);
  const __m256 vm = _mm256_set1_ps(mean), vr = _mm256_set1_ps(rstd);
  auto load = [&](const T* p) {
    const __m256 v = Vec<T>::load8(p);
    return NORM ? normalize8_avx2(v, vm, vr) : v;
  };
  __m256 u0 = _mm256_set1_ps(0.5f), u1 = u0;
  for (; e + 16 <= t; e += 16) {
    if (k.stochastic) {
      const uint64_t p = static_cast<uint64_t>(e) >> 1;  // pair of element e (e % 16 == 0)
      const __m256i pl = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(p))), k.iota);
      const __m256i hk = _mm256_set1_epi32(static_cast<int>(
          (static_cast<uint32_t>(p >> 32) ^ static_cast<uint32_t>(k.seed >> 32)) * kGolden));
      const __m256i h = hash32_avx2(_mm256_add_epi32(_mm256_xor_si256(pl, k.k0), hk));
      u0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(h, k.lo16)), k.scale);
      u1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 16)), k.scale);
    }
    const T* xp = xs + (e - s);
    const __m256i qa = quantize8_avx2(load(xp), vsh, viv, u0, k.vmax);
    const __m256i qb = quantize8_avx2(load(xp + 8), vsh, viv, u1, k.vmax);
    store_low_bytes16(qa, qb, out + (e - s));
  }
  return e;
}

// Min/max/non-finite of n values (n % 8 == 0) folded into vector accumulators lo/hi/bad, which
// stay vectors across the runs of one group (reduced to scalars once per thread, not per run).
template <bool NORM, typename T>
inline void minmax_acc_avx2(const T* p, int64_t n, __m256* lo, __m256* hi, __m256i* bad,
                            __m256 vm, __m256 vr) {
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  __m256 l = *lo, h = *hi;
  __m256i b = *bad;
  for (int64_t i = 0; i < n; i += 8) {
    __m256 a = Vec<T>::load8(p + i);
    if (NORM) a = normalize8_avx2(a, vm, vr);
    l = _mm256_min_ps(a, l);  // v < lo ? v : lo
    h = _mm256_max_ps(a, h);  // v > hi ? v : hi
    b = _mm256_or_si256(b, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(a), expo), expo));
  }
  *lo = l;
  *hi = h;
  *bad = b;
}

// Elements [s, e) of one group run (global indices; codes cc and out/mul at element s): 8 at a
// time, the table read by a gather; the product as the scalar loop takes it. Returns where it
// stopped (float only: other types return s, for the scalar loop).
template <typename T>
inline int64_t lut_run_avx2(const T*, const uint8_t*, const T*, T*, int64_t s, int64_t) {
  return s;
}
template <>
inline int64_t lut_run_avx2<float>(const float* tg, const uint8_t* cc, const float* mp, float* op,
                                   int64_t s, int64_t e) {
  int64_t i = s;
  for (; i + 8 <= e; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cc + (i - s))));
    __m256 v = _mm256_i32gather_ps(tg, idx, 4);
    if (mp != nullptr) v = _mm256_mul_ps(_mm256_loadu_ps(mp + i), v);
    _mm256_storeu_ps(op + i, v);
  }
  return i;
}

}  // namespace
}  // namespace mesa
#endif
