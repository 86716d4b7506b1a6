// CUDA kernels of Mesa's quantizer on the per-element math of quant_math.h: the twins of the CPU
// ops of quant_cpu.cpp (same arguments, same bits), launched on the current stream, with no host
// synchronisation anywhere (the running-range update and the non-finite flags stay on the GPU).
//
//   minmax_kernel    the range pass (quant_cuda_range.cuh) as a grid of (chunks, G) blocks, one
//                    chunk each; the last block to finish reduces the partials and finalizes: the
//                    (2, G) min/max, or the running-range update and the (4, G) rows to quantize with
//   quantize_kernel  packed codes; x read in place when row-strided (q/k/v of a fused qkv
//                    projection), optionally row-normalized (a LayerNorm's x-hat from its input
//                    and statistics)
//   dequantize_kernel / lut_kernel / levels_kernel: restore into a given buffer, a function of
//                    the stored tensor through a per-group table (GELU), the table's arguments
// The exact prefix rows (HeadRows, quant_math.h's head_index): quantize_kernel also copies them
// out of x, dequantize_kernel / lut_kernel write them over the restored rows (no copy launches).
//
// Vectorised (issue 36; helpers in quant_cuda_vec.cuh): a thread handles a run of consecutive
// elements, with one division for the run's first group (and row) and the rest stepped
// (GroupCursor / RowCursor), and every wide access through vcopy, taken only where the address
// is aligned to it (else the same run element by element):
//   quantize_kernel  runs of 16 elements -> 2 * bits bytes of codes, one 16/8/4/2-byte store; a
//                    contiguous x read in 16-byte loads (a strided x or a partial run: scalar
//                    loads, its row stepped; LayerNorm rows normalized after the load)
//   dequantize_kernel / lut_kernel: runs of 8 elements: their codes in one 8/4/2-byte load (1-bit:
//                    a byte), the values (and lut's mul) in 16-byte accesses; the head's rows
//                    (division per element, only when a head is given) and partial runs scalar
//   minmax_kernel    the data pass in runs of 8 of a group's elements: one wide load where the run
//                    lies in one row of `inner` of a contiguous x (not row-normalized), else
//                    scalar loads with the element index stepped across the group's rows
// The codes, noise (uniform(seed, e), keyed by the element) and values are those of the scalar
// kernels, bit for bit. Under MESA_CUDA_EMULATION vcopy checks alignment (a misaligned access
// fails the launch), as a GPU would fault where x86 does not.
//
// quantize_step_cuda = quantize_step_kernel (quant_cuda_steps.cuh, included at the end): the
// range pass, the finalize and the codes in one cooperative launch (grid-wide syncs between them;
// issue 36), for up to 3 tensors at once (an attention's q, k, v), else minmax_kernel +
// quantize_kernel (the last-block counter persists per stream). Index math is 32-bit wherever
// the sizes allow. The same file compiles for the host under MESA_CUDA_EMULATION
// (quant_cuda_emu.cpp, cuda_emulation.h), where the kernels run on CPU tensors: the tests check
// these kernels against the CPU kernels without a GPU.
#include <torch/extension.h>
#include <ATen/OpMathType.h>

#if defined(MESA_CUDA_EMULATION)
#include "cuda_emulation.h"
#define MESA_LAUNCH(kernel, grid, block, ...) \
  mesa_emu::launch((grid), (block), [&]() { kernel(__VA_ARGS__); })
#define MESA_GUARD(t)
#define MESA_ON_DEVICE(t) ((t).device().is_cpu())
#define MESA_DEVICE_NAME "emulated CUDA (CPU)"
#else
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#define MESA_LAUNCH(kernel, grid, block, ...)                                          \
  do {                                                                                 \
    kernel<<<(grid), (block), 0, at::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__);     \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                    \
  } while (0)
#define MESA_GUARD(t) const c10::cuda::CUDAGuard mesa_guard_((t).device())
#define MESA_ON_DEVICE(t) ((t).is_cuda())
#define MESA_DEVICE_NAME "CUDA"
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "quant_api.h"
#include "quant_math.h"
#include "quant_cuda_vec.cuh"
#include "quant_cuda_range.cuh"
#include "quant_cuda_launch.h"

namespace mesa {
namespace {

constexpr int kThreads = 256;  // a power of two (the block reductions halve it)

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(b, 1), 65535LL * 8));
}

// Runs f(I{}) with I = uint32_t when every index and offset below `extent` fits in 31 bits, else
// int64_t: index arithmetic (the cursors' steps along a run, the scalar paths' division and
// remainder) in 32 bits where the sizes allow.
template <typename F>
void with_index(int64_t extent, F&& f) {
#if defined(MESA_CUDA_EMULATION)
  if (mesa_emu::state().force_index64) extent = int64_t{1} << 31;
#endif
  if (extent < (int64_t{1} << 31))
    f(uint32_t{});
  else
    f(int64_t{});
}

// One chunk of one group per block (grid (chunks, G)); the last block to finish (a counter that
// persists per stream, reset by that block) reduces the partials and finalizes.
template <typename T, typename I, bool NORM>
__global__ void minmax_kernel(DRows<T, I> x, DNorm rn, I G, I inner, I per_group, I chunk,
                              float* __restrict__ part, unsigned* __restrict__ counter,
                              Finalize fin) {
  __shared__ float s_lo[kThreads];
  __shared__ float s_hi[kThreads];
  __shared__ int s_bad[kThreads];
  __shared__ bool s_last;
  const I chunks = gridDim.x;
  minmax_chunk<T, I, NORM>(x, rn, G, inner, per_group, chunk, static_cast<I>(blockIdx.x),
                           static_cast<I>(blockIdx.y), chunks, part, s_lo, s_hi, s_bad);
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1;
    if (s_last) *counter = 0u;  // every other block has counted: the next launch starts at 0
  }
  __syncthreads();
  if (!s_last) return;
  finalize_ranges<I>(part, G, chunks, fin, s_lo, s_hi, s_bad);
}

// The codes, and with hd.p the exact prefix rows of what is stored (x, or x-hat in float32).
// A thread packs runs of kQuantRun elements (2 * bits bytes: one store of 16/8/4/2 bytes where
// aligned); a contiguous x is read in wide loads, a row-strided one element by element with its
// row stepped; the group (and a LayerNorm row) is stepped, not divided, per element.
// inv / shift are read with plain loads (not const __restrict__): in quantize_step_kernel
// another block wrote them in the same launch, which the read-only cache path does not see.
template <typename T, typename I, bool NORM>
__device__ __forceinline__ void quantize_runs(const DRows<T, I>& x, const DNorm& rn,
                                              uint8_t* __restrict__ out, I n, I nbytes, int bits,
                                              I inner, I G, const float* inv, const float* shift,
                                              uint64_t seed, bool stochastic, const HeadRows& hd) {
  constexpr int R = kQuantRun;
  const float maxq = static_cast<float>((1u << bits) - 1u);
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  const I run_bytes = static_cast<I>(2 * bits);
  const I runs = (n + R - 1) / R;
  for (I k = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; k < runs; k += stride) {
    const I e0 = k * R;
    const int cnt = static_cast<int>(std::min<I>(R, n - e0));
    alignas(16) T buf[R];
    const bool wide = x.len == x.stride && cnt == R && run_aligned<T, R>(x.p + e0);
    if (wide) vcopy_run<R * sizeof(T)>(buf, x.p + e0);
    GroupCursor<I> gc(e0, inner, G);
    RowCursor<I> xr(e0, x.len);
    RowCursor<I> nr(e0, static_cast<I>(NORM ? rn.len : 1));
    // the codes, element i at bit i * bits of the 128 bits w[1]:w[0] (bits divides 64: no code
    // straddles the words); loops unrolled to R with a break, so indices stay compile-time
    // (buf, w and the restore kernels' arrays in registers)
    alignas(16) uint64_t w[2] = {0u, 0u};
    MESA_UNROLL
    for (int i = 0; i < R; ++i) {
      if (i >= cnt) break;
      float v = wide ? static_cast<float>(buf[i]) : static_cast<float>(x.p[xr.q * x.stride + xr.c]);
      if (NORM) v = normalize_one(v, rn.mean[nr.q], rn.rstd[nr.q]);
      uint32_t q;
      if (bits == 1)
        q = mask_one(v);
      else
        q = quantize_one(v, inv[gc.g], shift[gc.g], stochastic ? uniform(seed, e0 + i) : 0.5f, maxq);
      const int bit = i * bits;
      if (bit < 64)
        w[0] |= static_cast<uint64_t>(q) << bit;
      else
        w[1] |= static_cast<uint64_t>(q) << (bit - 64);
      gc.next();
      xr.next();
      if (NORM) nr.next();
    }
    uint8_t* o = out + k * run_bytes;
    if (cnt == R && store_codes(o, w, bits)) continue;
    const I nb = std::min<I>(run_bytes, nbytes - k * run_bytes);  // the bytes of this run
    for (I b = 0; b < nb; ++b)
      o[b] = static_cast<uint8_t>((b < 8 ? w[0] : w[1]) >> ((b & 7) * 8));
  }
  if (hd.p == nullptr) return;
  const I C = static_cast<I>(hd.C), N = static_cast<I>(hd.N), P = static_cast<I>(hd.P);
  for (I h = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; h < static_cast<I>(hd.n);
       h += stride) {
    const I e = head_source<I>(h, C, N, P);
    if constexpr (NORM)
      static_cast<float*>(hd.p)[h] = load<T, I, true>(x, rn, e);
    else
      static_cast<T*>(hd.p)[h] = x.raw(e);
  }
}

template <typename T, typename I, bool NORM>
__global__ void quantize_kernel(DRows<T, I> x, DNorm rn, uint8_t* __restrict__ out, I n,
                                I nbytes, int bits, I inner, I G, const float* __restrict__ inv,
                                const float* __restrict__ shift, uint64_t seed, bool stochastic,
                                HeadRows hd) {
  quantize_runs<T, I, NORM>(x, rn, out, n, nbytes, bits, inner, G, inv, shift, seed, stochastic, hd);
}

// What quantize_step_kernel packs once the range is final (quantize_kernel's arguments but the
// scales, which are the rows it finalizes).
template <typename I>
struct QuantArgs {
  uint8_t* out;
  I n, nbytes;
  int bits;
  uint64_t seed;
  bool stochastic;
  HeadRows hd;
};

// dequantize_kernel and lut_kernel: one restore loop (restore_runs, quant_cuda_vec.cuh), their
// values from a Run.

// out = code * step[g] + shift[g] (quant_math.h's dequantize_one).
template <typename T, typename I>
struct DequantRun {
  const float* __restrict__ step;
  const float* __restrict__ shift;
  __device__ __forceinline__ void begin(I, int) {}
  __device__ __forceinline__ T value(I, int, uint32_t q, I g) const {
    return static_cast<T>(dequantize_one(q, step[g], shift[g]));
  }
};

template <typename T, typename I>
__global__ void dequantize_kernel(const uint8_t* __restrict__ in, const float* __restrict__ step,
                                  const float* __restrict__ shift, T* __restrict__ out, I n,
                                  int bits, I inner, I G, HeadRows hd) {
  DequantRun<T, I> run{step, shift};
  restore_runs<T, I>(in, out, n, bits, inner, G, hd, run);
}

// out = table[g][code] (* mul, in the op-math type as torch's mul and the CPU kernel), mul read
// in one wide load per run where it is aligned.
template <typename T, typename I>
struct LutRun {
  using acc_t = at::opmath_type<T>;
  static constexpr int R = kRestoreRun;
  const T* __restrict__ table;
  const T* __restrict__ mul;
  I levels;
  bool wide_mul = false;
  alignas(16) T m[R];
  __device__ __forceinline__ void begin(I e0, int cnt) {
    wide_mul = mul != nullptr && cnt == R && run_aligned<T, R>(mul + e0);
    if (wide_mul) vcopy_run<R * sizeof(T)>(m, mul + e0);
  }
  __device__ __forceinline__ T value(I e0, int i, uint32_t q, I g) const {
    const T t = table[g * levels + q];
    if (mul == nullptr) return t;
    const T f = wide_mul ? m[i] : mul[e0 + i];
    return static_cast<T>(static_cast<acc_t>(f) * static_cast<acc_t>(t));
  }
};

template <typename T, typename I>
__global__ void lut_kernel(const uint8_t* __restrict__ in, const T* __restrict__ table,
                           const T* __restrict__ mul, T* __restrict__ out, I n, int bits, I inner,
                           I G, HeadRows hd) {
  LutRun<T, I> run{table, mul, static_cast<I>(1) << bits};
  restore_runs<T, I>(in, out, n, bits, inner, G, hd, run);
}

template <typename T>
__global__ void levels_kernel(const float* __restrict__ step, const float* __restrict__ shift,
                              T* __restrict__ out, int64_t G, int bits) {
  const int64_t levels = int64_t{1} << bits;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < G * levels;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t g = i / levels;
    out[i] = static_cast<T>(dequantize_one(static_cast<uint32_t>(i - g * levels), step[g], shift[g]));
  }
}

// ---- host side ------------------------------------------------------------------------------
void check_device_input(const char* op, const at::Tensor& x, int64_t groups, int64_t inner) {
  TORCH_CHECK(MESA_ON_DEVICE(x), "mesa ", op, ": x must be a ", MESA_DEVICE_NAME, " tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kDouble,
              "mesa ", op, ": x must be float64/32/16 or bfloat16, got ", x.scalar_type());
  check_group_args(op, x.numel(), groups, inner);
}

// The largest element offset any kernel computes for x read through row_layout.
int64_t extent_of(const at::Tensor& xr, int64_t row_len, int64_t row_stride) {
  const int64_t n = xr.numel();
  const int64_t rows = (n + row_len - 1) / std::max<int64_t>(row_len, 1);
  return std::max<int64_t>(n, rows * std::max(row_stride, row_len)) + 8;
}

// How the range pass splits each group of a tensor of n elements: chunks of at least
// kThreads * 8 elements, at most 2048 / groups of them (one block each).
struct ChunkPlan {
  int64_t per_group, chunk, chunks;
};
ChunkPlan chunk_plan(int64_t n, int64_t groups) {
  const int64_t per_group = n / groups;
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(
      (per_group + kThreads * 8 - 1) / (kThreads * 8), std::max<int64_t>(1, 2048 / groups)));
  const int64_t chunk = std::max<int64_t>(1, (per_group + want - 1) / want);
  return {per_group, chunk, std::max<int64_t>(1, (per_group + chunk - 1) / chunk)};
}

// The per-group min/max pass over x (any layout), finalized as `fin` says.
void launch_minmax(const at::Tensor& x, int64_t groups, int64_t inner, const float* mean,
                   const float* rstd, int64_t rn_len, Finalize fin) {
  int64_t row_len = 0, row_stride = 0;
  const at::Tensor xr = readable(x, inner, &row_len, &row_stride);
  const int64_t n = xr.numel();
  TORCH_CHECK(groups <= 65535, "mesa group_minmax: at most 65535 groups on CUDA, got ", groups);
  const ChunkPlan cp = chunk_plan(n, groups);
  const int64_t per_group = cp.per_group, chunk = cp.chunk, chunks = cp.chunks;
  auto part = at::empty({3, groups, chunks}, xr.options().dtype(at::kFloat));
  at::Tensor fresh;
  unsigned* u = persistent_counter(xr, &fresh);
  const DNorm rn{mean, rstd, std::max<int64_t>(rn_len, 1)};
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(groups));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xr.scalar_type(), "mesa_minmax_cuda", [&] {
    with_index(extent_of(xr, row_len, row_stride), [&](auto tag) {
      using I = decltype(tag);
      const DRows<scalar_t, I> rows{xr.data_ptr<scalar_t>(), static_cast<I>(row_len),
                                    static_cast<I>(row_stride)};
      if (mean != nullptr) {
        auto k = &minmax_kernel<scalar_t, I, true>;
        MESA_LAUNCH(k, grid, kThreads, rows, rn, static_cast<I>(groups), static_cast<I>(inner),
                    static_cast<I>(per_group), static_cast<I>(chunk), part.data_ptr<float>(), u, fin);
      } else {
        auto k = &minmax_kernel<scalar_t, I, false>;
        MESA_LAUNCH(k, grid, kThreads, rows, rn, static_cast<I>(groups), static_cast<I>(inner),
                    static_cast<I>(per_group), static_cast<I>(chunk), part.data_ptr<float>(), u, fin);
      }
    });
  });
}

void launch_quantize(const at::Tensor& x, const float* inv, const float* shift, int64_t bits,
                     int64_t groups, int64_t inner, int64_t seed, bool stochastic, uint8_t* out,
                     const float* mean = nullptr, const float* rstd = nullptr, int64_t rn_len = 1,
                     HeadRows hd = HeadRows()) {
  int64_t row_len = 0, row_stride = 0;
  const at::Tensor xr = readable(x, inner, &row_len, &row_stride);
  const int64_t n = xr.numel();
  if (n == 0) return;
  const int64_t per = 8 / bits;
  const int64_t nbytes = (n + per - 1) / per;
  const int64_t runs = (n + kQuantRun - 1) / kQuantRun;
  const DNorm rn{mean, rstd, std::max<int64_t>(rn_len, 1)};
  const uint64_t useed = static_cast<uint64_t>(seed);
  const int b = static_cast<int>(bits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xr.scalar_type(), "mesa_quantize_cuda", [&] {
    with_index(extent_of(xr, row_len, row_stride), [&](auto tag) {
      using I = decltype(tag);
      const DRows<scalar_t, I> rows{xr.data_ptr<scalar_t>(), static_cast<I>(row_len),
                                    static_cast<I>(row_stride)};
      if (mean != nullptr) {
        auto k = &quantize_kernel<scalar_t, I, true>;
        MESA_LAUNCH(k, blocks_for(runs), kThreads, rows, rn, out, static_cast<I>(n),
                    static_cast<I>(nbytes), b, static_cast<I>(inner), static_cast<I>(groups), inv,
                    shift, useed, stochastic, hd);
      } else {
        auto k = &quantize_kernel<scalar_t, I, false>;
        MESA_LAUNCH(k, blocks_for(runs), kThreads, rows, rn, out, static_cast<I>(n),
                    static_cast<I>(nbytes), b, static_cast<I>(inner), static_cast<I>(groups), inv,
                    shift, useed, stochastic, hd);
      }
    });
  });
}

at::Tensor packed_for(const at::Tensor& x, int64_t bits) {
  const int64_t per = 8 / bits;
  return at::empty({(x.numel() + per - 1) / per}, x.options().dtype(at::kByte));
}

Finalize range_finalize(at::Tensor& clip_val, at::Tensor& shift, at::Tensor& iteration,
                        at::Tensor& rows, double decay, double one_minus_decay,
                        int64_t range_mode, int64_t bits, bool update, bool mark_nonfinite) {
  return Finalize{kRange, nullptr, clip_val.data_ptr<float>(), shift.data_ptr<float>(),
                  iteration.data_ptr<float>(), rows.data_ptr<float>(),
                  static_cast<float>(decay), static_cast<float>(one_minus_decay),
                  static_cast<float>((1u << bits) - 1u), static_cast<int>(range_mode), update,
                  mark_nonfinite};
}

}  // namespace

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                         int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic) {
  check_device_input("quantize_cuda", x, groups, inner);
  check_bits("quantize", bits);
  check_params("quantize", inv, shift, groups, x.device());
  MESA_GUARD(x);
  auto out = packed_for(x, bits);
  launch_quantize(x, inv.data_ptr<float>(), shift.data_ptr<float>(), bits, groups, inner, seed,
                  stochastic, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor dequantize_out_cuda(const at::Tensor& packed, const at::Tensor& step,
                               const at::Tensor& shift, int64_t bits, int64_t groups,
                               int64_t inner, at::Tensor out, const std::optional<at::Tensor>& head) {
  const int64_t n = out.numel();
  check_dequantize_args(packed, step, shift, bits, groups, inner, n);
  TORCH_CHECK(MESA_ON_DEVICE(packed) && out.device() == packed.device() && out.is_contiguous(),
              "mesa dequantize_out_cuda: packed and a contiguous out must be ", MESA_DEVICE_NAME,
              " tensors on one device");
  const HeadRows hd = head_rows("dequantize_out", head, n, out.scalar_type(), out.device());
  MESA_GUARD(packed);
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "mesa_dequantize_cuda", [&] {
    with_index(n + 8, [&](auto tag) {
      using I = decltype(tag);
      auto k = &dequantize_kernel<scalar_t, I>;
      MESA_LAUNCH(k, blocks_for((n + kRestoreRun - 1) / kRestoreRun), kThreads, packed.data_ptr<uint8_t>(), step.data_ptr<float>(),
                  shift.data_ptr<float>(), out.data_ptr<scalar_t>(), static_cast<I>(n),
                  static_cast<int>(bits), static_cast<I>(inner), static_cast<I>(groups), hd);
    });
  });
  return out;
}

at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                           int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                           at::ScalarType dtype) {
  auto out = at::empty({numel}, packed.options().dtype(dtype));
  return dequantize_out_cuda(packed, step, shift, bits, groups, inner, out, std::nullopt);
}

at::Tensor lut_apply_out_cuda(const at::Tensor& packed, const at::Tensor& table, int64_t bits,
                              int64_t groups, int64_t inner, at::Tensor out,
                              const std::optional<at::Tensor>& mul,
                              const std::optional<at::Tensor>& head) {
  const int64_t n = out.numel();
  check_packed_args("lut_apply", packed, bits, groups, inner, n);
  const at::Device dev = packed.device();
  TORCH_CHECK(MESA_ON_DEVICE(packed) && out.device() == dev && out.is_contiguous(),
              "mesa lut_apply: out must be a contiguous tensor on the device of packed");
  const int64_t levels = int64_t{1} << bits;
  TORCH_CHECK(table.device() == dev && table.is_contiguous() && table.scalar_type() == out.scalar_type() &&
                  table.dim() == 2 && table.size(0) == groups && table.size(1) == levels,
              "mesa lut_apply: table must be a contiguous (", groups, ", ", levels,
              ") tensor of out's dtype and device");
  const bool has_mul = mul.has_value() && mul->defined();
  if (has_mul)
    TORCH_CHECK(mul->device() == dev && mul->is_contiguous() && mul->numel() == n &&
                    mul->scalar_type() == out.scalar_type(),
                "mesa lut_apply: mul must be a contiguous tensor of out's dtype, size and device");
  const HeadRows hd = head_rows("lut_apply", head, n, out.scalar_type(), dev);
  MESA_GUARD(packed);
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "mesa_lut_apply_cuda", [&] {
    with_index(n + 8, [&](auto tag) {
      using I = decltype(tag);
      auto k = &lut_kernel<scalar_t, I>;
      MESA_LAUNCH(k, blocks_for((n + kRestoreRun - 1) / kRestoreRun), kThreads, packed.data_ptr<uint8_t>(), table.data_ptr<scalar_t>(),
                  has_mul ? mul->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(),
                  static_cast<I>(n), static_cast<int>(bits), static_cast<I>(inner),
                  static_cast<I>(groups), hd);
    });
  });
  return out;
}

at::Tensor levels_cuda(const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                       at::ScalarType dtype) {
  check_bits("levels", bits);
  const int64_t groups = step.numel();
  check_params("levels", step, shift, groups, step.device());
  TORCH_CHECK(MESA_ON_DEVICE(step), "mesa levels: step must be a ", MESA_DEVICE_NAME, " tensor");
  MESA_GUARD(step);
  auto out = at::empty({groups, int64_t{1} << bits}, step.options().dtype(dtype));
  if (groups == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mesa_levels_cuda", [&] {
    auto k = &levels_kernel<scalar_t>;
    MESA_LAUNCH(k, blocks_for(out.numel()), kThreads, step.data_ptr<float>(),
                shift.data_ptr<float>(), out.data_ptr<scalar_t>(), groups, static_cast<int>(bits));
  });
  return out;
}

// Per-group (min, max) as a (2, G) float tensor; a group holding NaN/Inf (or whose range
// overflows) gets NaN in both rows, as group_minmax_cpu.
at::Tensor group_minmax_cuda(const at::Tensor& x, int64_t groups, int64_t inner) {
  check_device_input("group_minmax_cuda", x, groups, inner);
  MESA_GUARD(x);
  auto out = at::empty({2, groups}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return out.fill_(std::numeric_limits<float>::quiet_NaN());
  Finalize fin{kMinMax, out.data_ptr<float>()};
  launch_minmax(x, groups, inner, nullptr, nullptr, 1, fin);
  return out;
}

at::Tensor range_update_cuda(const at::Tensor& x, int64_t groups, int64_t inner,
                             at::Tensor clip_val, at::Tensor shift, at::Tensor iteration,
                             double decay, double one_minus_decay, int64_t range_mode,
                             int64_t bits, bool update) {
  check_device_input("range_update_cuda", x, groups, inner);
  check_range_args("range_update", clip_val, shift, iteration, groups, range_mode, x.device());
  check_bits("range_update", bits);
  TORCH_CHECK(x.numel() > 0, "mesa range_update_cuda: x is empty");
  MESA_GUARD(x);
  auto rows = at::empty({4, groups}, x.options().dtype(at::kFloat));
  launch_minmax(x, groups, inner, nullptr, nullptr, 1,
                range_finalize(clip_val, shift, iteration, rows, decay, one_minus_decay,
                               range_mode, bits, update, false));
  return rows;
}

// The seed prefix source of quantize_step's prefix_of_mix: CRC-32 of the 16 bytes
// torch.cuda.default_generators[device].get_state() returns (uint64 seed, int64 offset), read
// on the host (= mesa_ops.ops.torch_fingerprint for a CUDA device). Emulated: the CPU
// generator's (the emulated device is the CPU).
int64_t generator_fingerprint_cuda(int64_t device) {
#if defined(MESA_CUDA_EMULATION)
  (void)device;
  return generator_fingerprint_cpu();
#else
  auto gen = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(device));
  uint64_t seed = 0;
  int64_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = gen.get<at::CUDAGeneratorImpl>();
    seed = impl->current_seed();
    offset = static_cast<int64_t>(impl->philox_offset_per_thread());
  }
  uint8_t b[16];
  std::memcpy(b, &seed, 8);
  std::memcpy(b + 8, &offset, 8);
  return crc32_bytes(b, 16);
#endif
}

}  // namespace mesa

#include "quant_cuda_steps.cuh"  // (quantize_step_cuda and the ops of several calls)
