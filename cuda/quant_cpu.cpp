// CPU kernels of Mesa's quantizer, built on the per-element math in quant_math.h.
// Parallel over tiles of elements with at::parallel_for; inside a tile, runs of one group are
// processed with constant scale/shift so the compiler can vectorise the loop.
#include <torch/extension.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "quant_math.h"
#include "quant_api.h"
#include "quant_cpu_avx2.h"
#include "quant_cpu_avx512.h"

namespace mesa {
namespace {

constexpr int64_t kTile = 4096;  // elements per tile; a multiple of 16 so tiles pack to whole bytes

// The elements of x in logical (row-major) order: element e lies at
// p + (e / row_len) * row_stride + e % row_len. A contiguous tensor is one row; a tensor whose
// last dim is contiguous and whose leading dims collapse to one stride (q, k, v sliced out of a
// fused qkv projection) is read in place, without a copy.
template <typename T>
struct Rows {
  const T* p;
  int64_t row_len;
  int64_t row_stride;
  // A read position that advances by whole runs, none crossing a row end (row_len is a
  // multiple of the group size): one division when it is made, none per run.
  struct Cursor {
    const Rows* rows;
    int64_t row, col;
    const T* take(int64_t n) {
      const T* q = rows->p + row * rows->row_stride + col;
      col += n;
      if (col == rows->row_len) {
        col = 0;
        ++row;
      }
      return q;
    }
  };
  Cursor cursor(int64_t e) const { return {this, e / row_len, e % row_len}; }
};

// Optional per-row normalization applied to x before the range and the codes: element e reads
// as (x[e] - mean[e / len]) * rstd[e / len] (a LayerNorm's x-hat from its input and statistics).
// A group segment of `inner` elements lies in one such row (len % inner == 0, checked).
struct RowNorm {
  const float* mean = nullptr;
  const float* rstd = nullptr;
  int64_t len = 1;
};

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

// Codes of elements [begin, end) of one tile into codes[0, end - begin). A run of one group lies
// in one row of `x` (contiguous); the row is tracked as the runs advance (no division per run).
template <typename scalar_t>
void quantize_tile(const Rows<scalar_t>& x, uint8_t* __restrict__ codes, int64_t begin,
                   int64_t end, const float* inv, const float* shift, int64_t inner, int64_t groups,
                   int bits, uint64_t seed, bool stochastic, const RowNorm& rn) {
  const float maxq = static_cast<float>((1u << bits) - 1u);
  const bool norm = rn.mean != nullptr;
#if defined(__AVX2__)
  const QuantConsts k(maxq, seed, stochastic);
#endif
#if defined(MESA_HAVE_AVX512)
  const QuantConsts512 k16(maxq, seed);
#endif
  auto cur = x.cursor(begin);
  for_group_runs(begin, end, inner, groups, [&](int64_t s, int64_t t, int64_t g) {
    const scalar_t* __restrict__ xs = cur.take(t - s);
    uint8_t* __restrict__ out = codes + (s - begin);
    if (bits == 1) {
      for (int64_t e = s; e < t; ++e) out[e - s] = static_cast<uint8_t>(mask_one(static_cast<float>(xs[e - s])));
      return;
    }
    const float iv = inv[g];
    const float sh = shift[g];
    const float m = norm ? rn.mean[s / rn.len] : 0.0f;
    const float r = norm ? rn.rstd[s / rn.len] : 1.0f;
    auto one = [&](int64_t e) {
      const float u = stochastic ? uniform(seed, e) : 0.5f;
      const float v = static_cast<float>(xs[e - s]);
      out[e - s] = static_cast<uint8_t>(quantize_one(norm ? normalize_one(v, m, r) : v, iv, sh, u, maxq));
    };
    int64_t e = s;
    const int64_t head = std::min(t, (s + 15) & ~static_cast<int64_t>(15));
    for (; e < head; ++e) one(e);
#if defined(__AVX2__)
    if constexpr (Vec<scalar_t>::value) {
#if defined(MESA_HAVE_AVX512)
      e = norm ? quantize_run_avx512<true>(xs, out, s, e, t, iv, sh, k, k16, m, r)
               : quantize_run_avx512<false>(xs, out, s, e, t, iv, sh, k, k16, m, r);
#endif
      e = norm ? quantize_run_avx2<true>(xs, out, s, e, t, iv, sh, k, m, r)
               : quantize_run_avx2<false>(xs, out, s, e, t, iv, sh, k, m, r);
    }
#endif
    for (; e < t; ++e) one(e);
  });
}

// Packs n codes of BITS bits (low bits first) into ceil(n * BITS / 8) bytes (BITS a template
// parameter: constant trip counts, vectorised loops).
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

// Calls f(s, e, g, codes) for each run [s, e) of one group over the packed codes of numel
// elements (codes: the run's one-byte codes, unpacked per tile below 8 bits), tiles of kTile
// in parallel: the loop dequantize_out_cpu and lut_apply_out_cpu share.
template <typename F>
void for_code_runs(const uint8_t* in, int64_t numel, int bits, int64_t inner, int64_t groups,
                   F&& f) {
  const int per = 8 / bits;
  const int64_t ntiles = (numel + kTile - 1) / kTile;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> codes(bits == 8 ? 0 : kTile);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = t * kTile;
      const int64_t end = std::min(numel, begin + kTile);
      const uint8_t* c = in + begin;
      if (bits != 8) {
        unpack_codes(in + begin / per, end - begin, bits, codes.data());
        c = codes.data();
      }
      for_group_runs(begin, end, inner, groups,
                     [&](int64_t s, int64_t e, int64_t g) { f(s, e, g, c + (s - begin)); });
    }
  });
}

// The exact prefix rows into `out` (contiguous, of the head's dtype): each head row of C
// elements over its row of out (head_source), after the codes were restored there.
void put_head(at::Tensor& out, const HeadRows& hr) {
  if (hr.p == nullptr) return;
  const int64_t es = out.element_size();
  char* o = static_cast<char*>(out.data_ptr());
  const char* h = static_cast<const char*>(hr.p);
  for (int64_t k = 0; k < hr.n; k += hr.C)
    std::memcpy(o + head_source<int64_t>(k, hr.C, hr.N, hr.P) * es, h + k * es, hr.C * es);
}

// The exact prefix rows of what quantize_step stores (x, or its float32 x-hat) into the head
// (head_source: element h holds x's element e). A head row (C elements along the last dim) lies
// in one readable row of x and one row of the statistics: one index computation per head row.
void take_head(const at::Tensor& x, int64_t inner, const RowNorm& rn, const HeadRows& hr) {
  if (hr.p == nullptr) return;
  int64_t row_len = 0, row_stride = 0;
  const at::Tensor xr = readable(x, inner, &row_len, &row_stride);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xr.scalar_type(), "mesa_head_cpu", [&] {
    const scalar_t* p = xr.data_ptr<scalar_t>();
    for (int64_t h = 0; h < hr.n; h += hr.C) {
      const int64_t e = head_source<int64_t>(h, hr.C, hr.N, hr.P);
      const scalar_t* src = p + (e / row_len) * row_stride + e % row_len;
      if (rn.mean != nullptr) {
        const float m = rn.mean[e / rn.len], r = rn.rstd[e / rn.len];
        float* out = static_cast<float*>(hr.p) + h;
        for (int64_t c = 0; c < hr.C; ++c) out[c] = normalize_one(static_cast<float>(src[c]), m, r);
      } else {
        std::memcpy(static_cast<scalar_t*>(hr.p) + h, src, hr.C * sizeof(scalar_t));
      }
    }
  });
}

}  // namespace

namespace {

void quantize_into(const at::Tensor& x, const float* iv, const float* sh, int64_t bits,
                   int64_t groups, int64_t inner, int64_t seed, bool stochastic, uint8_t* o,
                   const RowNorm& rn = RowNorm()) {
  int64_t row_len = 0, row_stride = 0;
  const at::Tensor xr = readable(x, inner, &row_len, &row_stride);
  const int64_t n = xr.numel();
  const int per = 8 / static_cast<int>(bits);
  const uint64_t useed = static_cast<uint64_t>(seed);
  const int b = static_cast<int>(bits);
  const int64_t ntiles = (n + kTile - 1) / kTile;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xr.scalar_type(), "mesa_quantize_cpu", [&] {
    const Rows<scalar_t> rows{xr.data_ptr<scalar_t>(), row_len, row_stride};
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<uint8_t> codes(b == 8 ? 0 : kTile);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t begin = t * kTile;
        const int64_t end = std::min(n, begin + kTile);
        if (b == 8) {
          quantize_tile(rows, o + begin, begin, end, iv, sh, inner, groups, b, useed, stochastic, rn);
        } else {
          quantize_tile(rows, codes.data(), begin, end, iv, sh, inner, groups, b, useed, stochastic, rn);
          pack_codes(codes.data(), end - begin, b, o + begin / per);
        }
      }
    });
  });
}

// Per-group min/max/non-finite of x (any layout) into lo/hi (NaN where non-finite).
void group_minmax_into(const at::Tensor& x, int64_t groups, int64_t inner, float* out_lo,
                       float* out_hi, const RowNorm& rn = RowNorm()) {
  int64_t row_len = 0, row_stride = 0;
  const at::Tensor xr = readable(x, inner, &row_len, &row_stride);
  const int64_t segments = xr.numel() / inner;  // outer * groups
  const int nthreads = at::get_num_threads();
  // one slot of G values per thread, padded to 64 bytes so threads never share a cache line
  const int64_t slot = (groups + 15) / 16 * 16;
  const float inf = std::numeric_limits<float>::infinity();
  // (small-buffer vectors: the usual few groups and threads take no heap allocation)
  c10::SmallVector<float, 64> mins(static_cast<size_t>(nthreads * slot), inf);
  c10::SmallVector<float, 64> maxs(static_cast<size_t>(nthreads * slot), -inf);
  c10::SmallVector<uint32_t, 64> bad(static_cast<size_t>(nthreads * slot), 0u);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xr.scalar_type(), "mesa_group_minmax_cpu", [&] {
    const Rows<scalar_t> rows{xr.data_ptr<scalar_t>(), row_len, row_stride};
    const int64_t grain = std::max<int64_t>(1, 32768 / inner);
    at::parallel_for(0, segments, grain, [&](int64_t s0, int64_t s1) {
      c10::SmallVector<float, 16> mn(static_cast<size_t>(groups), inf), mx(static_cast<size_t>(groups), -inf);
      c10::SmallVector<uint32_t, 16> bd(static_cast<size_t>(groups), 0u);
      const bool norm = rn.mean != nullptr;
#if defined(__AVX2__)
      // whole segments of 8 go through per-group vector accumulators
      const bool vec = Vec<scalar_t>::value && inner % 8 == 0;
      std::vector<__m256> vlo(vec ? groups : 0, _mm256_set1_ps(inf));
      std::vector<__m256> vhi(vec ? groups : 0, _mm256_set1_ps(-inf));
      std::vector<__m256i> vbd(vec ? groups : 0, _mm256_setzero_si256());
#endif
      int64_t g = s0 % groups;
      auto cur = rows.cursor(s0 * inner);
      for (int64_t s = s0; s < s1; ++s) {
        const scalar_t* p = cur.take(inner);
        const float m = norm ? rn.mean[s * inner / rn.len] : 0.0f;
        const float r = norm ? rn.rstd[s * inner / rn.len] : 1.0f;
#if defined(__AVX2__)
        if (vec) {
          if constexpr (Vec<scalar_t>::value) {
#if defined(MESA_HAVE_AVX512)
            if (inner % 16 == 0) {
              if (norm)
                minmax_acc_avx512<true>(p, inner, &vlo[g], &vhi[g], &vbd[g], m, r);
              else
                minmax_acc_avx512<false>(p, inner, &vlo[g], &vhi[g], &vbd[g], m, r);
              g = (g + 1 == groups) ? 0 : g + 1;
              continue;
            }
#endif
            const __m256 vm = _mm256_set1_ps(m), vr = _mm256_set1_ps(r);
            if (norm)
              minmax_acc_avx2<true>(p, inner, &vlo[g], &vhi[g], &vbd[g], vm, vr);
            else
              minmax_acc_avx2<false>(p, inner, &vlo[g], &vhi[g], &vbd[g], vm, vr);
          }
          g = (g + 1 == groups) ? 0 : g + 1;
          continue;
        }
#endif
        float l = mn[g], h = mx[g];
        uint32_t nf = 0;
        for (int64_t i = 0; i < inner; ++i) {
          const float v = norm ? normalize_one(static_cast<float>(p[i]), m, r) : static_cast<float>(p[i]);
          uint32_t b;
          std::memcpy(&b, &v, sizeof(b));
          l = v < l ? v : l;
          h = v > h ? v : h;
          nf |= nonfinite_bits(b) ? 1u : 0u;
        }
        mn[g] = l;
        mx[g] = h;
        bd[g] |= nf;
        g = (g + 1 == groups) ? 0 : g + 1;
      }
#if defined(__AVX2__)
      if (vec) {
        alignas(32) float l8[8], h8[8];
        for (int64_t q = 0; q < groups; ++q) {
          _mm256_store_ps(l8, vlo[q]);
          _mm256_store_ps(h8, vhi[q]);
          for (int j = 0; j < 8; ++j) {
            mn[q] = l8[j] < mn[q] ? l8[j] : mn[q];
            mx[q] = h8[j] > mx[q] ? h8[j] : mx[q];
          }
          bd[q] |= _mm256_testz_si256(vbd[q], vbd[q]) ? 0u : 1u;
        }
      }
#endif
      const int64_t base = static_cast<int64_t>(at::get_thread_num()) * slot;
      for (int64_t g = 0; g < groups; ++g) {
        mins[base + g] = std::min(mins[base + g], mn[g]);
        maxs[base + g] = std::max(maxs[base + g], mx[g]);
        bad[base + g] |= bd[g];
      }
    });
  });
  for (int64_t g = 0; g < groups; ++g) {
    float lo = inf, hi = -inf;
    bool b = false;
    for (int t = 0; t < nthreads; ++t) {
      lo = std::min(lo, mins[t * slot + g]);
      hi = std::max(hi, maxs[t * slot + g]);
      b = b || bad[t * slot + g];
    }
    b = b || !finite_range(lo, hi);  // (as reference.group_minmax: an overflowing range too)
    out_lo[g] = b ? std::numeric_limits<float>::quiet_NaN() : lo;
    out_hi[g] = b ? std::numeric_limits<float>::quiet_NaN() : hi;
  }
}

// An uninitialised (ceil(numel * bits / 8),) uint8 tensor for the packed codes of x.
at::Tensor packed_for(const at::Tensor& x, int64_t bits) {
  const int64_t per = 8 / bits;
  return at::empty({(x.numel() + per - 1) / per}, x.options().dtype(at::kByte));
}

void check_cpu_input(const char* op, const at::Tensor& x, int64_t groups, int64_t inner) {
  TORCH_CHECK(x.device().is_cpu(), "mesa ", op, ": x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kDouble,
              "mesa ", op, ": x must be float64/32/16 or bfloat16, got ", x.scalar_type());
  check_group_args(op, x.numel(), groups, inner);
}

// The running-range update of Mesa in place, writing the (4, G) rows inv, step, shift, finite
// into o; returns whether every group was finite.
bool range_update_into(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor& clip_val,
                       at::Tensor& shift, at::Tensor& iteration, double decay,
                       double one_minus_decay, int64_t range_mode, int64_t bits, bool update,
                       float* o, const RowNorm& rn = RowNorm()) {
  check_range_args("range_update", clip_val, shift, iteration, groups, range_mode, x.device());
  check_bits("range_update", bits);
  c10::SmallVector<float, 16> lo(static_cast<size_t>(groups)), hi(static_cast<size_t>(groups));
  group_minmax_into(x, groups, inner, lo.data(), hi.data(), rn);
  bool finite = true;
  for (int64_t g = 0; g < groups; ++g) {
    const bool f = std::isfinite(lo[g]) && std::isfinite(hi[g]);
    o[3 * groups + g] = f ? 1.0f : 0.0f;
    finite = finite && f;
  }
  float* clip = clip_val.data_ptr<float>();
  float* sh = shift.data_ptr<float>();
  float* it = iteration.data_ptr<float>();
  const bool ok = finite && update;
  const bool take = range_mode == kRangeBatch || it[0] == 0.0f;
  const float levels = static_cast<float>((1u << bits) - 1u);
  for (int64_t g = 0; g < groups; ++g)
    finalize_group(lo[g], hi[g], ok, take, static_cast<float>(decay),
                   static_cast<float>(one_minus_decay), static_cast<int>(range_mode), levels,
                   clip + g, sh + g, o + g, groups);
  if (ok) it[0] += 1.0f;
  return finite;
}

}  // namespace

// Packed codes of x: any layout (read in place when its rows allow, else copied contiguous).
at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                        int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic) {
  check_cpu_input("quantize_cpu", x, groups, inner);
  check_bits("quantize", bits);
  check_params("quantize", inv, shift, groups, x.device());
  auto out = packed_for(x, bits);
  quantize_into(x, inv.data_ptr<float>(), shift.data_ptr<float>(), bits, groups, inner, seed,
                stochastic, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor dequantize_out_cpu(const at::Tensor& packed, const at::Tensor& step,
                              const at::Tensor& shift, int64_t bits, int64_t groups, int64_t inner,
                              at::Tensor out, const std::optional<at::Tensor>& head) {
  const int64_t numel = out.numel();
  check_dequantize_args(packed, step, shift, bits, groups, inner, numel);
  TORCH_CHECK(packed.device().is_cpu() && out.device().is_cpu(),
              "mesa dequantize_cpu: packed and out must be CPU tensors");
  TORCH_CHECK(out.is_contiguous(), "mesa dequantize_out_cpu: out must be contiguous");
  const HeadRows hr = head_rows("dequantize_out", head, numel, out.scalar_type(), out.device());
  const at::ScalarType dtype = out.scalar_type();
  const float* st = step.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  const uint8_t* in = packed.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mesa_dequantize_cpu", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for_code_runs(in, numel, static_cast<int>(bits), inner, groups,
                  [&](int64_t s, int64_t e, int64_t g, const uint8_t* cc) {
      const float stp = st[g];
      const float sft = sh[g];
      for (int64_t i = s; i < e; ++i)
        op[i] = static_cast<scalar_t>(dequantize_one(cc[i - s], stp, sft));
    });
  });
  put_head(out, hr);
  return out;
}



// out = table[g][code] (* mul, elementwise, when given): a function of the stored tensor through a
// 2^bits-entry table per group (Mesa GELU: its output, its derivative). table (G, 2^bits), mul and
// out: out's dtype, mul and out contiguous; the product in the op-math type (float for fp16/bf16),
// as torch's mul. `head` (HeadRows): out's first rows along dim -2 as they are.
at::Tensor lut_apply_out_cpu(const at::Tensor& packed, const at::Tensor& table, int64_t bits,
                             int64_t groups, int64_t inner, at::Tensor out,
                             const std::optional<at::Tensor>& mul,
                             const std::optional<at::Tensor>& head) {
  const int64_t numel = out.numel();
  check_packed_args("lut_apply", packed, bits, groups, inner, numel);
  TORCH_CHECK(packed.device().is_cpu(), "mesa lut_apply: packed must be a CPU tensor");
  const int64_t levels = int64_t{1} << bits;
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "mesa lut_apply: out must be a contiguous CPU tensor");
  TORCH_CHECK(table.device().is_cpu() && table.is_contiguous() && table.scalar_type() == out.scalar_type() &&
                  table.dim() == 2 && table.size(0) == groups && table.size(1) == levels,
              "mesa lut_apply: table must be a contiguous (", groups, ", ", levels, ") CPU tensor of out's dtype");
  const bool has_mul = mul.has_value() && mul->defined();
  if (has_mul)
    TORCH_CHECK(mul->device().is_cpu() && mul->is_contiguous() && mul->numel() == numel &&
                    mul->scalar_type() == out.scalar_type(),
                "mesa lut_apply: mul must be a contiguous CPU tensor of out's dtype and size");
  const HeadRows hr = head_rows("lut_apply", head, numel, out.scalar_type(), out.device());
  const uint8_t* in = packed.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "mesa_lut_apply_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* tab = table.data_ptr<scalar_t>();
    const scalar_t* mp = has_mul ? mul->data_ptr<scalar_t>() : nullptr;
    for_code_runs(in, numel, static_cast<int>(bits), inner, groups,
                  [&](int64_t s, int64_t e, int64_t g, const uint8_t* cc) {
      const scalar_t* tg = tab + g * levels;
      int64_t i = s;
#if defined(__AVX2__)
      i = lut_run_avx2<scalar_t>(tg, cc, mp, op, s, e);
#endif
      if (mp != nullptr) {
        for (; i < e; ++i)
          op[i] = static_cast<scalar_t>(static_cast<acc_t>(mp[i]) * static_cast<acc_t>(tg[cc[i - s]]));
      } else {
        for (; i < e; ++i) op[i] = tg[cc[i - s]];
      }
    });
  });
  put_head(out, hr);
  return out;
}

// (G, 2^bits): the value each code of each group dequantizes to (code * step + shift, exactly
// as dequantize_out_cpu computes it), in dtype: the arguments of a table for lut_apply_out_cpu.
at::Tensor levels_cpu(const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                      at::ScalarType dtype) {
  check_bits("levels", bits);
  const int64_t groups = step.numel();
  check_params("levels", step, shift, groups, step.device());
  const int64_t levels = int64_t{1} << bits;
  auto out = at::empty({groups, levels}, step.options().dtype(dtype));
  const float* st = step.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mesa_levels_cpu", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t q = 0; q < levels; ++q)
        o[g * levels + q] = static_cast<scalar_t>(dequantize_one(static_cast<uint32_t>(q), st[g], sh[g]));
  });
  return out;
}

at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                          int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                          at::ScalarType dtype) {
  auto out = at::empty({numel}, packed.options().dtype(dtype));
  dequantize_out_cpu(packed, step, shift, bits, groups, inner, out, std::nullopt);
  return out;
}

// Per-group min and max of x viewed as (outer, G, inner): a (2, G) float tensor. A group that
// holds NaN or Inf gets NaN in both rows, so the caller detects it with one isfinite check.
at::Tensor group_minmax_cpu(const at::Tensor& x, int64_t groups, int64_t inner) {
  check_cpu_input("group_minmax_cpu", x, groups, inner);
  auto out = at::empty({2, groups}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  group_minmax_into(x, groups, inner, o, o + groups);
  return out;
}

// Per-group min/max of x, the running-range update of (clip_val, shift, iteration) in place, and
// the scales to quantize x with: a (4, G) float tensor of rows inv, step, shift, finite (1/0).
// If any group holds NaN/Inf, or `update` is false (checkpoint recomputation), the state is left
// unchanged.
at::Tensor range_update_cpu(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                            at::Tensor shift, at::Tensor iteration, double decay,
                            double one_minus_decay, int64_t range_mode, int64_t bits,
                            bool update) {
  check_cpu_input("range_update_cpu", x, groups, inner);
  auto out = at::empty({4, groups}, x.options().dtype(at::kFloat));
  range_update_into(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
                    range_mode, bits, update, out.data_ptr<float>());
  return out;
}

namespace {
constexpr size_t kFingerprintBytes = 64;  // = mesa_ops.ops.FINGERPRINT_BYTES
}  // namespace

// CRC-32 of the first kFingerprintBytes bytes of torch's default CPU generator state (of the
// bytes torch.default_generator.get_state() returns: the initial seed, the position in the
// Mersenne-Twister block (left, seeded, next) and state words 0-4, which every regeneration of
// the block changes), read from the engine without drawing from it and without get_state's
// copy of the whole state: mesa_ops.ops.torch_fingerprint.
int64_t generator_fingerprint_cpu() {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::mt19937_data_pod d;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    d = gen.get<at::CPUGeneratorImpl>()->engine().data();
  }
  // get_state()'s legacy layout: uint64 seed, int32 left, int32 seeded, uint64 next, uint64 words
  uint8_t b[kFingerprintBytes];
  const uint64_t seed = d.seed_, next = d.next_;
  const int32_t left = d.left_, seeded = d.seeded_ ? 1 : 0;
  std::memcpy(b, &seed, 8);
  std::memcpy(b + 8, &left, 4);
  std::memcpy(b + 12, &seeded, 4);
  std::memcpy(b + 16, &next, 8);
  for (size_t i = 0; i < (kFingerprintBytes - 24) / 8; ++i) {
    const uint64_t w = d.state_[i];
    std::memcpy(b + 24 + 8 * i, &w, 8);
  }
  return crc32_bytes(b, kFingerprintBytes);
}

// One call for what a Mesa layer does to store an activation: range_update_cpu, then quantize_cpu
// with its rows (inv, shift), in one dispatch, a strided x read in place. mark_nonfinite: a
// non-finite group's shift is NaN (nonfinite='skip'). Seed: ops.make_seed's, splitmix64(prefix ^ n)
// (62 bits), n = draws[0] (advanced when `update`); prefix ops.seed_prefix, or with prefix_of_mix
// splitmix64(generator_fingerprint_cpu() ^ mix), mix = ops.salt_mix (the state hashed here).
// `head` (HeadRows: x.narrow(-2, 0, P)'s shape, contiguous, x's dtype or float32 with row
// statistics): the first P rows along dim -2 of what is stored, written there exactly.
// Returns (packed, step (G,), shift (G,), all finite, (4, G) rows); step / shift: rows 1 and 2.
namespace {
// quantize_step_cpu; with `head_sizes` (not null, not empty) the exact prefix rows are not given
// but made here, in `head_dtype`, in the same allocation as the rows and codes (between them:
// their offset, 16 * G bytes, is aligned for any dtype), and returned in `head_out`
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool, at::Tensor> quantize_step_impl(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head,
    const std::vector<int64_t>* head_sizes, at::ScalarType head_dtype, at::Tensor* head_out,
    bool own_rows = false) {
  check_cpu_input("quantize_step_cpu", x, groups, inner);
  RowNorm rn;
  rn.len = row_norm_len("quantize_step_cpu", x, inner, row_mean, row_rstd);
  // one allocation for the (4, G) rows, the exact prefix rows made here (if any) and the codes
  // after them; the tensors returned are views of it made without a dispatch (one storage: a
  // saved copy is counted once, as before)
  const int64_t per = 8 / bits;
  const int64_t nbytes = (x.numel() + per - 1) / per;
  int64_t head_bytes = 0;
  std::optional<at::Tensor> own_head;
  if (head_sizes != nullptr && !head_sizes->empty()) {
    int64_t n = 1;
    for (const int64_t s : *head_sizes) n *= s;
    head_bytes = n * static_cast<int64_t>(c10::elementSize(head_dtype));
  }
  // (own_rows: the rows in an allocation of their own, the codes and head rows in another)
  const int64_t rows_bytes = own_rows ? 0 : 16 * groups;
  const at::Tensor block = at::empty({rows_bytes + head_bytes + nbytes}, x.options().dtype(at::kByte));
  if (head_bytes > 0) {
    own_head = storage_view(block, head_dtype, rows_bytes / static_cast<int64_t>(c10::elementSize(head_dtype)),
                            *head_sizes);
    *head_out = *own_head;
  }
  const HeadRows hr = head_rows_of("quantize_step_cpu", head_bytes > 0 ? own_head : head, x, rn.len > 0);
  if (rn.len > 0) {
    rn.mean = row_mean->data_ptr<float>();
    rn.rstd = row_rstd->data_ptr<float>();
  } else {
    rn.len = 1;
  }
  const int64_t seed = stochastic ? draw_seed(draws, static_cast<uint64_t>(seed_prefix),
                                              prefix_of_mix,
                                              prefix_of_mix ? generator_fingerprint_cpu() : 0,
                                              update)
                                   : 0;
  const at::Tensor params = own_rows ? at::empty({4, groups}, x.options().dtype(at::kFloat))
                                     : storage_view(block, at::kFloat, 0, {4, groups});
  float* o = params.data_ptr<float>();
  const bool finite = range_update_into(x, groups, inner, clip_val, shift, iteration, decay,
                                        one_minus_decay, range_mode, bits, update, o, rn);
  if (!finite && mark_nonfinite) {
    for (int64_t g = 0; g < groups; ++g)
      if (o[3 * groups + g] == 0.0f) o[2 * groups + g] = std::numeric_limits<float>::quiet_NaN();
  }
  const at::Tensor packed = storage_view(block, at::kByte, rows_bytes + head_bytes, {nbytes});
  quantize_into(x, o, o + 2 * groups, bits, groups, inner, seed, stochastic,
                packed.data_ptr<uint8_t>(), rn);
  take_head(x, inner, rn, hr);
  if (own_rows) return {packed, params[1], params[2], finite, params};
  return {packed, storage_view(block, at::kFloat, groups, {groups}),
          storage_view(block, at::kFloat, 2 * groups, {groups}), finite, params};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, bool, at::Tensor> quantize_step_cpu(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head) {
  return quantize_step_impl(x, groups, inner, std::move(clip_val), std::move(shift), std::move(iteration), decay,
                            one_minus_decay, range_mode, bits, update, seed_prefix, std::move(draws), stochastic,
                            mark_nonfinite, prefix_of_mix, row_mean, row_rstd, head, nullptr, at::kFloat, nullptr);
}

std::tuple<at::Tensor, bool, at::Tensor> quantize_step_cpu_own_rows(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix) {
  auto r = quantize_step_impl(x, groups, inner, std::move(clip_val), std::move(shift), std::move(iteration), decay,
                              one_minus_decay, range_mode, bits, update, seed_prefix, std::move(draws), stochastic,
                              mark_nonfinite, prefix_of_mix, std::nullopt, std::nullopt, std::nullopt, nullptr,
                              at::kFloat, nullptr, /*own_rows=*/true);
  return {std::get<0>(r), std::get<3>(r), std::get<4>(r)};
}

StepResult quantize_step_cpu_plan(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                                  at::Tensor shift, at::Tensor iteration, double decay, double one_minus_decay,
                                  int64_t range_mode, int64_t bits, bool update, int64_t mix, at::Tensor draws,
                                  bool stochastic, bool mark_nonfinite, const std::optional<at::Tensor>& row_mean,
                                  const std::optional<at::Tensor>& row_rstd, const std::vector<int64_t>& head_sizes,
                                  at::ScalarType head_dtype) {
  at::Tensor head;
  auto r = quantize_step_impl(x, groups, inner, std::move(clip_val), std::move(shift), std::move(iteration), decay,
                              one_minus_decay, range_mode, bits, update, mix, std::move(draws), stochastic,
                              mark_nonfinite, stochastic, row_mean, row_rstd, std::nullopt, &head_sizes, head_dtype,
                              &head);
  return StepResult(std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r), head);
}

}  // namespace mesa
