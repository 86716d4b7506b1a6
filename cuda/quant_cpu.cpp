// CPU kernels of Mesa's quantizer, built on the per-element math in quant_math.h.
// Parallel over tiles of elements with at::parallel_for; inside a tile, runs of one group are
// processed with constant scale/shift so the compiler can vectorise the loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "quant_math.h"
#include "quant_api.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mesa {
namespace {

constexpr int64_t kTile = 4096;  // elements per tile; a multiple of 8 so tiles pack to whole bytes

#if defined(__AVX2__)
// AVX2 versions of the fp32 loops: the same IEEE operations in the same order as quant_math.h
// (sub, mul, add as separate instructions; max/min with the header's operand order), so the
// results are bit-identical to the scalar code and the reference (the tests check this).
inline __m256i hash32_avx2(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHashMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kHashMul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

inline void store_low_bytes(__m256i q, uint8_t* out) {  // byte 0 of each 32-bit lane -> 8 bytes
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(q, pick);
  const __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), both);
}

// Codes of n fp32 values of one group; returns how many were done (a multiple of 8).
inline int64_t quantize_run_avx2(const float* xs, uint8_t* out, int64_t n, float iv, float sh,
                                 float maxq, uint64_t seed, uint32_t lo0, uint32_t hi,
                                 bool stochastic) {
  const __m256 viv = _mm256_set1_ps(iv), vsh = _mm256_set1_ps(sh), vmax = _mm256_set1_ps(maxq);
  const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
  const __m256 scale = _mm256_set1_ps(1.0f / 16777216.0f);
  const __m256i k0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed)));
  const __m256i hk = _mm256_set1_epi32(
      static_cast<int>((hi ^ static_cast<uint32_t>(seed >> 32)) * kGolden));
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo0)),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    __m256 u = half;
    if (stochastic) {
      const __m256i h = hash32_avx2(_mm256_add_epi32(_mm256_xor_si256(idx, k0), hk));
      u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), scale);
      idx = _mm256_add_epi32(idx, eight);
    }
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xs + e), vsh), viv);
    v = _mm256_add_ps(v, u);
    v = _mm256_max_ps(v, zero);  // v > 0 ? v : 0  (NaN -> 0)
    v = _mm256_min_ps(v, vmax);  // v < maxq ? v : maxq
    store_low_bytes(_mm256_cvttps_epi32(v), out + e);
  }
  return e;
}

// Running min/max/non-finite over n fp32 values; returns how many were done.
inline int64_t minmax_run_avx2(const float* p, int64_t n, float* lo, float* hi, uint32_t* bad) {
  __m256 vlo = _mm256_set1_ps(*lo), vhi = _mm256_set1_ps(*hi);
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  __m256i vbad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    vlo = _mm256_min_ps(v, vlo);  // v < lo ? v : lo
    vhi = _mm256_max_ps(v, vhi);  // v > hi ? v : hi
    const __m256i b = _mm256_and_si256(_mm256_castps_si256(v), expo);
    vbad = _mm256_or_si256(vbad, _mm256_cmpeq_epi32(b, expo));
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, vlo);
  _mm256_store_ps(h, vhi);
  for (int j = 0; j < 8; ++j) {
    *lo = l[j] < *lo ? l[j] : *lo;
    *hi = h[j] > *hi ? h[j] : *hi;
  }
  *bad |= _mm256_testz_si256(vbad, vbad) ? 0u : 1u;
  return i;
}
#endif

// Calls f(begin, end, group) for the maximal runs of [begin, end) that lie in one group.
template <typename F>
inline void for_group_runs(int64_t begin, int64_t end, int64_t inner, int64_t groups, F&& f) {
  int64_t e = begin;
  int64_t g = group_of(e, inner, groups);
  int64_t pos = e % inner;
  while (e < end) {
    const int64_t stop = std::min(end, e + (inner - pos));
    f(e, stop, g);
    e = stop;
    pos = 0;
    g = (g + 1 == groups) ? 0 : g + 1;
  }
}

// Codes of elements [begin, end) of one tile (which never crosses a 2^32 index boundary, since
// tiles are aligned to kTile, a power of two).
template <typename scalar_t>
void quantize_tile(const scalar_t* __restrict__ x, uint8_t* __restrict__ codes, int64_t begin,
                   int64_t end, const float* inv, const float* shift, int64_t inner, int64_t groups,
                   int bits, uint64_t seed, bool stochastic) {
  const float maxq = static_cast<float>((1u << bits) - 1u);
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(begin) >> 32);
  for_group_runs(begin, end, inner, groups, [&](int64_t s, int64_t t, int64_t g) {
    const float iv = inv[g];
    const float sh = shift[g];
    const scalar_t* __restrict__ xs = x + s;
    uint8_t* __restrict__ out = codes + (s - begin);
    const int64_t n = t - s;
    const uint32_t lo0 = static_cast<uint32_t>(static_cast<uint64_t>(s));
    if (bits == 1) {
      for (int64_t e = 0; e < n; ++e) out[e] = static_cast<uint8_t>(mask_one(static_cast<float>(xs[e])));
    } else if (stochastic) {
      int64_t e = 0;
#if defined(__AVX2__)
      if constexpr (std::is_same_v<scalar_t, float>)
        e = quantize_run_avx2(xs, out, n, iv, sh, maxq, seed, lo0, hi, true);
#endif
      for (; e < n; ++e) {
        const float u = uniform_lohi(seed, lo0 + static_cast<uint32_t>(e), hi);
        out[e] = static_cast<uint8_t>(quantize_one(static_cast<float>(xs[e]), iv, sh, u, maxq));
      }
    } else {
      int64_t e = 0;
#if defined(__AVX2__)
      if constexpr (std::is_same_v<scalar_t, float>)
        e = quantize_run_avx2(xs, out, n, iv, sh, maxq, seed, lo0, hi, false);
#endif
      for (; e < n; ++e)
        out[e] = static_cast<uint8_t>(quantize_one(static_cast<float>(xs[e]), iv, sh, 0.5f, maxq));
    }
  });
}

// Packs n codes of BITS bits (low bits first) into ceil(n * BITS / 8) bytes. BITS is a template
// parameter so the inner loops have constant trip counts and vectorise.
template <int BITS>
inline void pack_codes_t(const uint8_t* __restrict__ codes, int64_t n, uint8_t* __restrict__ out) {
  constexpr int per = 8 / BITS;
  const int64_t full = n / per;
  for (int64_t k = 0; k < full; ++k) {
    uint32_t byte = 0;
    for (int j = 0; j < per; ++j) byte |= static_cast<uint32_t>(codes[k * per + j]) << (j * BITS);
    out[k] = static_cast<uint8_t>(byte);
  }
  if (full * per < n) {
    uint32_t byte = 0;
    for (int64_t e = full * per; e < n; ++e) byte |= static_cast<uint32_t>(codes[e]) << ((e - full * per) * BITS);
    out[full] = static_cast<uint8_t>(byte);
  }
}

template <int BITS>
inline void unpack_codes_t(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ codes) {
  constexpr int per = 8 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  const int64_t full = n / per;
  for (int64_t k = 0; k < full; ++k)
    for (int j = 0; j < per; ++j)
      codes[k * per + j] = static_cast<uint8_t>((static_cast<uint32_t>(in[k]) >> (j * BITS)) & mask);
  for (int64_t e = full * per; e < n; ++e)
    codes[e] = static_cast<uint8_t>((static_cast<uint32_t>(in[full]) >> ((e - full * per) * BITS)) & mask);
}

inline void pack_codes(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  switch (bits) {
    case 4: pack_codes_t<4>(codes, n, out); break;
    case 2: pack_codes_t<2>(codes, n, out); break;
    default: pack_codes_t<1>(codes, n, out); break;
  }
}

inline void unpack_codes(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
  switch (bits) {
    case 4: unpack_codes_t<4>(in, n, codes); break;
    case 2: unpack_codes_t<2>(in, n, codes); break;
    default: unpack_codes_t<1>(in, n, codes); break;
  }
}

}  // namespace

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                        int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic) {
  check_quantize_args(x, inv, shift, bits, groups, inner);
  TORCH_CHECK(x.device().is_cpu(), "mesa quantize_cpu: x must be a CPU tensor");
  const int64_t n = x.numel();
  const int per = 8 / static_cast<int>(bits);
  auto out = at::empty({(n + per - 1) / per}, x.options().dtype(at::kByte));
  const float* iv = inv.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint64_t useed = static_cast<uint64_t>(seed);
  const int b = static_cast<int>(bits);
  const int64_t ntiles = (n + kTile - 1) / kTile;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mesa_quantize_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint8_t> codes(b == 8 ? 0 : kTile);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t begin = t * kTile;
        const int64_t end = std::min(n, begin + kTile);
        if (b == 8) {
          quantize_tile(xp, o + begin, begin, end, iv, sh, inner, groups, b, useed, stochastic);
        } else {
          quantize_tile(xp, codes.data(), begin, end, iv, sh, inner, groups, b, useed, stochastic);
          pack_codes(codes.data(), end - begin, b, o + begin / per);
        }
      }
    });
  });
  return out;
}

void dequantize_out_cpu(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                        int64_t bits, int64_t groups, int64_t inner, at::Tensor out) {
  const int64_t numel = out.numel();
  check_dequantize_args(packed, step, shift, bits, groups, inner, numel);
  TORCH_CHECK(packed.device().is_cpu() && out.device().is_cpu(),
              "mesa dequantize_cpu: packed and out must be CPU tensors");
  TORCH_CHECK(out.is_contiguous(), "mesa dequantize_out_cpu: out must be contiguous");
  const at::ScalarType dtype = out.scalar_type();
  const float* st = step.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  const uint8_t* in = packed.data_ptr<uint8_t>();
  const int b = static_cast<int>(bits);
  const int per = 8 / b;
  const int64_t ntiles = (numel + kTile - 1) / kTile;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mesa_dequantize_cpu", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint8_t> codes(b == 8 ? 0 : kTile);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t begin = t * kTile;
        const int64_t end = std::min(numel, begin + kTile);
        const uint8_t* c = in + begin;
        if (b != 8) {
          unpack_codes(in + begin / per, end - begin, b, codes.data());
          c = codes.data();
        }
        for_group_runs(begin, end, inner, groups, [&](int64_t s, int64_t e, int64_t g) {
          const float stp = st[g];
          const float sft = sh[g];
          const uint8_t* cc = c + (s - begin);
          for (int64_t i = s; i < e; ++i)
            op[i] = static_cast<scalar_t>(dequantize_one(cc[i - s], stp, sft));
        });
      }
    });
  });
}


at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                          int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                          at::ScalarType dtype) {
  auto out = at::empty({numel}, packed.options().dtype(dtype));
  dequantize_out_cpu(packed, step, shift, bits, groups, inner, out);
  return out;
}

// Per-group min and max of x viewed as (outer, G, inner): a (2, G) float tensor. A group that
// holds NaN or Inf gets NaN in both rows, so the caller detects it with one isfinite check.
at::Tensor group_minmax_cpu(const at::Tensor& x, int64_t groups, int64_t inner) {
  TORCH_CHECK(x.device().is_cpu(), "mesa group_minmax_cpu: x must be a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), "mesa group_minmax: x must be contiguous");
  TORCH_CHECK(groups > 0 && inner > 0 && x.numel() % (groups * inner) == 0,
              "mesa group_minmax: numel ", x.numel(), " is not a multiple of groups*inner = ",
              groups, "*", inner);
  const int64_t segments = x.numel() / inner;  // outer * groups
  const int nthreads = at::get_num_threads();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> mins(static_cast<size_t>(nthreads) * groups, inf);
  std::vector<float> maxs(static_cast<size_t>(nthreads) * groups, -inf);
  std::vector<uint8_t> bad(static_cast<size_t>(nthreads) * groups, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mesa_group_minmax_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / inner);
    at::parallel_for(0, segments, grain, [&](int64_t s0, int64_t s1) {
      const size_t tid = static_cast<size_t>(at::get_thread_num());
      float* mn = mins.data() + tid * groups;
      float* mx = maxs.data() + tid * groups;
      uint8_t* bd = bad.data() + tid * groups;
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t g = s % groups;
        const scalar_t* p = xp + s * inner;
        // 8 independent lanes: the compiler vectorises these (a single running min would
        // be a float reduction, which it may not reorder).
        float lo[8], hi[8];
        uint32_t nf[8];
        for (int j = 0; j < 8; ++j) { lo[j] = mn[g]; hi[j] = mx[g]; nf[j] = 0; }
        int64_t i = 0;
#if defined(__AVX2__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          i = minmax_run_avx2(reinterpret_cast<const float*>(p), inner, &lo[0], &hi[0], &nf[0]);
        }
#endif
        for (; i + 8 <= inner; i += 8) {
          for (int j = 0; j < 8; ++j) {
            const float v = static_cast<float>(p[i + j]);
            uint32_t b;
            std::memcpy(&b, &v, sizeof(b));
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            nf[j] |= nonfinite_bits(b) ? 1u : 0u;
          }
        }
        for (; i < inner; ++i) {
          const float v = static_cast<float>(p[i]);
          uint32_t b;
          std::memcpy(&b, &v, sizeof(b));
          lo[0] = v < lo[0] ? v : lo[0];
          hi[0] = v > hi[0] ? v : hi[0];
          nf[0] |= nonfinite_bits(b) ? 1u : 0u;
        }
        float l = lo[0], h = hi[0];
        uint32_t bad_any = nf[0];
        for (int j = 1; j < 8; ++j) {
          l = lo[j] < l ? lo[j] : l;
          h = hi[j] > h ? hi[j] : h;
          bad_any |= nf[j];
        }
        mn[g] = l;
        mx[g] = h;
        bd[g] |= static_cast<uint8_t>(bad_any);
      }
    });
  });
  auto out = at::empty({2, groups}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g) {
    float lo = inf, hi = -inf;
    bool b = false;
    for (int t = 0; t < nthreads; ++t) {
      lo = std::min(lo, mins[static_cast<size_t>(t) * groups + g]);
      hi = std::max(hi, maxs[static_cast<size_t>(t) * groups + g]);
      b = b || bad[static_cast<size_t>(t) * groups + g];
    }
    o[g] = b ? std::numeric_limits<float>::quiet_NaN() : lo;
    o[groups + g] = b ? std::numeric_limits<float>::quiet_NaN() : hi;
  }
  return out;
}

// Per-group min/max of x, the running-range update of (clip_val, shift, iteration) in place, and
// the scales to quantize x with: a (4, G) float tensor of rows inv, step, shift, finite (1/0).
// If any group holds NaN/Inf, or `update` is false (checkpoint recomputation), the state is left
// unchanged.
at::Tensor range_update_cpu(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                            at::Tensor shift, at::Tensor iteration, double decay,
                            double one_minus_decay, bool batch_mode, int64_t bits,
                            bool update) {
  for (const at::Tensor* t : {&clip_val, &shift}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == groups &&
                    t->device().is_cpu(),
                "mesa range_update: clip_val/shift must be contiguous float32 CPU tensors of ",
                groups, " elements");
  }
  TORCH_CHECK(iteration.scalar_type() == at::kFloat && iteration.numel() == 1,
              "mesa range_update: iteration must be a float32 tensor of 1 element");
  check_bits("range_update", bits);
  const at::Tensor mm = group_minmax_cpu(x, groups, inner);
  const float* lo = mm.data_ptr<float>();
  const float* hi = lo + groups;
  auto out = at::empty({4, groups}, mm.options());
  float* o = out.data_ptr<float>();
  bool finite = true;
  for (int64_t g = 0; g < groups; ++g) {
    const bool f = std::isfinite(lo[g]) && std::isfinite(hi[g]);
    o[3 * groups + g] = f ? 1.0f : 0.0f;
    finite = finite && f;
  }
  float* clip = clip_val.data_ptr<float>();
  float* sh = shift.data_ptr<float>();
  float* it = iteration.data_ptr<float>();
  if (finite && update) {
    const bool take = batch_mode || it[0] == 0.0f;
    for (int64_t g = 0; g < groups; ++g)
      update_range_one(lo[g], hi[g], take, static_cast<float>(decay),
                       static_cast<float>(one_minus_decay), clip + g, sh + g);
    it[0] += 1.0f;
  }
  const float levels = static_cast<float>((1u << bits) - 1u);
  for (int64_t g = 0; g < groups; ++g) {
    scales_one(clip[g], levels, o + g, o + groups + g);
    o[2 * groups + g] = sh[g];
  }
  return out;
}

}  // namespace mesa
