// Per-element math of Mesa's activation quantizer, shared by the CPU kernel (quant_cpu.cpp)
// and the CUDA kernel (quant_cuda.cu). mesa_ops/reference.py implements the same functions in
// plain PyTorch; tests assert that the kernels equal it bit for bit.
//
// Quantize (b bits, L = 2^b - 1, per group g: inv = L / range_g, shift_g = running min):
//     v = (x - shift_g) * inv_g + u          u ~ U[0,1) (stochastic) or 0.5 (nearest)
//     q = trunc(clamp(v, 0, L))              == floor for v >= 0; values outside the range clamp
// Dequantize (step_g = range_g / L):
//     x_hat = q * step_g + shift_g
// bits == 1 is the ReLU mask: q = (x > 0), dequantized as q * step + shift with step 1, shift 0.
//
// Every float operation is a single IEEE-rounded op (no FMA contraction: the CUDA path uses the
// _rn intrinsics, the CPU path is built with -ffp-contract=off), so CPU, CUDA and the PyTorch
// reference give identical bits.
//
// Noise: a counter-based generator with 16 random bits per element, one 32-bit hash per two
// elements. Within each aligned block of 16 elements, element e is paired with e + 8: pair
// p = (e >> 4) * 8 + (e & 7) (so p = e / 2 for the first element of a block), and with a 64-bit
// seed h = H((lo32(p) ^ lo32(seed)) + (hi32(p) ^ hi32(seed)) * 0x9e3779b9 mod 2^32), where H is a
// 32-bit integer hash (one round of a "lowbias32"-style xorshift-multiply) whose multipliers are
// below 2^31 (so the int64 reference never overflows). The first 8 elements of the block take the
// low 16 bits of h, the next 8 the high 16 bits: u = bits16 * 2^-16, in [0, 1), exact in fp32.
// A SIMD loop gets 16 noises from one 8-lane hash.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MESA_HD __host__ __device__ __forceinline__
#else
#define MESA_HD inline
#endif

namespace mesa {

constexpr uint32_t kHashMul1 = 0x21f0aaadu;
constexpr uint32_t kHashMul2 = 0x735a2d97u;
constexpr uint32_t kGolden = 0x9e3779b9u;  // mixes the high words in (mod 2^32)

MESA_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= kHashMul1;
  x ^= x >> 15;
  x *= kHashMul2;
  x ^= x >> 15;
  return x;
}

// The hash of pair p under seed (p and seed split into their 32-bit words).
MESA_HD uint32_t pair_hash(uint64_t seed, uint32_t p_lo, uint32_t p_hi) {
  return hash32((p_lo ^ static_cast<uint32_t>(seed)) +
                (p_hi ^ static_cast<uint32_t>(seed >> 32)) * kGolden);
}

constexpr float kNoiseScale = 1.0f / 65536.0f;

// Uniform noise in [0, 1) (16 random bits) of element `index`.
MESA_HD float uniform(uint64_t seed, int64_t index) {
  const uint64_t e = static_cast<uint64_t>(index);
  const uint64_t p = ((e >> 4) << 3) | (e & 7u);
  const uint32_t h = pair_hash(seed, static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32));
  const uint32_t b = (e & 8u) ? (h >> 16) : (h & 0xffffu);
  return static_cast<float>(static_cast<int32_t>(b)) * kNoiseScale;
}

MESA_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MESA_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MESA_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// A LayerNorm's normalized value (x - mean) * rstd, as the reference computes x-hat (a Mesa
// LayerNorm stores x-hat; the CPU kernel normalizes each row while quantizing it).
MESA_HD float normalize_one(float x, float mean, float rstd) { return fmul(fsub(x, mean), rstd); }

// One element to its b-bit code. maxq = 2^b - 1 as float. `noise` is u or 0.5.
MESA_HD uint32_t quantize_one(float x, float inv, float shift, float noise, float maxq) {
  float v = fadd(fmul(fsub(x, shift), inv), noise);
  v = v > 0.0f ? v : 0.0f;      // NaN -> 0 (NaN is rejected before quantizing by default)
  v = v < maxq ? v : maxq;
  return static_cast<uint32_t>(static_cast<int32_t>(v));  // truncation == floor for v >= 0
}

// True for +-Inf and NaN (exponent bits all ones), on the bit pattern so loops vectorise.
MESA_HD bool nonfinite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

MESA_HD uint32_t mask_one(float x) { return x > 0.0f ? 1u : 0u; }

MESA_HD float dequantize_one(uint32_t q, float step, float shift) {
  return fadd(fmul(static_cast<float>(q), step), shift);
}

MESA_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---- per-group running range (Pan et al., Sec. 3.2: running estimates) ----------------------
// Range modes (mesa_ops.quant.RANGE_MODES, in this order):
//   kRangeEma   the paper's rule: the stored copy is quantized with the running range; values
//               beyond it are clamped to its edges (a bias wherever the batch exceeds the range)
//   kRangeBatch the batch's own min/max every step (no state kept between steps in effect)
//   kRangeUnion the running range as kRangeEma updates it, but each stored copy is quantized with
//               the union of that range and the batch's min/max: nothing is ever clamped, so
//               stochastic rounding stays unbiased for every value (the default)
constexpr int kRangeEma = 0;
constexpr int kRangeBatch = 1;
constexpr int kRangeUnion = 2;

// One group's update from the batch's min `lo` and max `hi`. first/batch_mode: take the batch's
// range; else EMA: clip = clip * d + (hi - lo) * c and shift = shift * d + lo * c, c = 1 - d
// (d and c are given, both rounded from double to float, as the PyTorch reference does).
MESA_HD void update_range_one(float lo, float hi, bool take_batch, float d, float c, float* clip,
                              float* shift) {
  const float rng = fsub(hi, lo);
  if (take_batch) {
    *clip = rng;
    *shift = lo;
  } else {
    *clip = fadd(fmul(*clip, d), fmul(rng, c));
    *shift = fadd(fmul(*shift, d), fmul(lo, c));
  }
}

constexpr float kRangeEps = 1e-8f;

// Scales for quantizing with range `clip`: inv = L / r and step = r / L, r = max(clip, eps).
MESA_HD void scales_one(float clip, float levels, float* inv, float* step) {
  const float r = clip > kRangeEps ? clip : kRangeEps;
  *inv = fdiv(levels, r);
  *step = fdiv(r, levels);
}

// The range (offset *qlo, width *qrange) a group's stored copy is quantized with, from its
// (already updated) running state (clip, shift) and the batch's lo/hi: the state's range, or under
// kRangeUnion its union with [lo, hi]. NaN lo/hi (a non-finite group) leave the state's range.
MESA_HD void quant_range_one(int mode, float lo, float hi, float clip, float shift, float* qlo,
                             float* qrange) {
  if (mode != kRangeUnion) {
    *qlo = shift;
    *qrange = clip;
    return;
  }
  const float top = fadd(shift, clip);
  const float l = lo < shift ? lo : shift;
  const float h = hi > top ? hi : top;
  *qlo = l;
  *qrange = fsub(h, l);
}

// Whether a group's batch statistics are usable: lo, hi and hi - lo finite (a range that
// overflows float32, e.g. -3e38 and 3e38 in one group, counts as non-finite).
MESA_HD bool finite_range(float lo, float hi) {
  const float r = fsub(hi, lo);
  return fsub(r, r) == 0.0f && fsub(lo, lo) == 0.0f;  // x - x == 0 exactly when x is finite
}

// One group of the fused range step: the running-range update of (clip, shift) when `ok` (every
// group finite and not a recomputation), then the rows the batch is quantized with -- inv, step
// (from the range of quant_range_one) and the offset -- written to o[0 * G], o[1 * G], o[2 * G]
// (o points at group g's column of the (4, G) rows; row 3, the finite flag, is the caller's).
MESA_HD void finalize_group(float lo, float hi, bool ok, bool take, float d, float c, int mode,
                            float levels, float* clip, float* shift, float* o, int64_t G) {
  if (ok) update_range_one(lo, hi, take, d, c, clip, shift);
  float qlo, qr;
  quant_range_one(mode, lo, hi, *clip, *shift, &qlo, &qr);
  scales_one(qr, levels, o, o + G);
  o[2 * G] = qlo;
}

// ---- the exact prefix rows (mesa_ops.packed.QTensor.head): the first P of the N rows along
// dim -2 of a tensor whose last two dims are (N, C), kept exactly beside its codes, shaped like
// x.narrow(-2, 0, P) and contiguous. The quantize / dequantize / table kernels write them.
// Element e of the tensor (row-major) -> its index *h in the head; false when its row is >= P.
template <typename I>
MESA_HD bool head_index(I e, I C, I N, I P, I* h) {
  const I r = e / C;  // the row over all leading dims
  const I n = r % N;
  if (n >= P) return false;
  *h = (r / N * P + n) * C + (e - r * C);
  return true;
}

// Head element h -> the element e of the tensor it holds (head_index's inverse).
template <typename I>
MESA_HD I head_source(I h, I C, I N, I P) {
  const I r = h / C;  // the head row over all leading dims
  return (r / P * N + r % P) * C + (h - r * C);
}

// Element e of a tensor viewed as (outer, G, inner) belongs to group (e / inner) % G.
MESA_HD int64_t group_of(int64_t e, int64_t inner, int64_t groups) { return (e / inner) % groups; }

}  // namespace mesa
