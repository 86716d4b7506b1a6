// Host-side launch helpers of quant_cuda.cu: the persistent last-block counter of
// minmax_kernel, and the cooperative launch of quantize_step_kernel (how many blocks the device
// holds at once; the launch itself). Emulated (MESA_CUDA_EMULATION, cuda_emulation.h): a counter
// per thread, mesa_emu::state().coop_blocks and mesa_emu::launch_cooperative.
#pragma once
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace mesa {
namespace {

// minmax_kernel's last-block counter: one zeroed int per (device, stream), allocated (and zeroed)
// on first use and reset to 0 by the last block of every launch, so a call costs no fill launch.
// Launches on one stream run in order, so they never share it concurrently. The cache is never
// destroyed (device memory must not be freed after the CUDA context at exit). While the stream
// is captured into a CUDA graph, the call gets a counter of its own instead (`fresh`, zeroed by
// a fill the graph captures: each replay starts from 0 whatever stream replays it, and no fill of
// the shared one is captured instead of run).
unsigned* persistent_counter(const at::Tensor& like, at::Tensor* fresh) {
#if defined(MESA_CUDA_EMULATION)
  // emulated: the launches of a thread run in order (one counter per thread, as per stream)
  (void)fresh;
  static thread_local at::Tensor mine;
  if (!mine.defined()) mine = at::zeros({1}, like.options().dtype(at::kInt));
  return reinterpret_cast<unsigned*>(mine.data_ptr<int>());
#else
  if (at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None) {
    *fresh = at::zeros({1}, like.options().dtype(at::kInt));
    return reinterpret_cast<unsigned*>(fresh->data_ptr<int>());
  }
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<int, int64_t>, at::Tensor>();
  const std::pair<int, int64_t> key{static_cast<int>(like.device().index()),
                                    static_cast<int64_t>(at::cuda::getCurrentCUDAStream().id())};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it == cache->end())
    it = cache->emplace(key, at::zeros({1}, like.options().dtype(at::kInt))).first;
  return reinterpret_cast<unsigned*>(it->second.data_ptr<int>());
#endif
}

#if !defined(MESA_CUDA_EMULATION)
using CoopKey = std::tuple<const void*, int, int>;  // (kernel, device, threads)
std::mutex& coop_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<CoopKey, int>& coop_cache() {
  static auto* cache = new std::map<CoopKey, int>();
  return *cache;
}
// The driver refused a cooperative launch of `kernel` on the current device: none from now on.
void coop_refused(const void* kernel, int threads) {
  std::lock_guard<std::mutex> lock(coop_mutex());
  coop_cache()[CoopKey{kernel, static_cast<int>(c10::cuda::current_device()), threads}] = 0;
}
#endif

// The most blocks of `kernel` the current device runs at once (every block resident: what a
// cooperative launch needs), cached per (kernel, device, threads); 0 where there is no
// cooperative launch: a device without it or that refused one (coop_refused), or a stream being
// captured into a CUDA graph (the two launches are captured instead). Emulated:
// mesa_emu::state().coop_blocks.
int coop_capacity(const void* kernel, int threads) {
#if defined(MESA_CUDA_EMULATION)
  (void)kernel;
  (void)threads;
  return mesa_emu::state().coop_blocks;
#else
  if (at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None) return 0;
  const int dev = static_cast<int>(c10::cuda::current_device());
  std::lock_guard<std::mutex> lock(coop_mutex());
  auto* cache = &coop_cache();
  const CoopKey key{kernel, dev, threads};
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  int coop = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (coop != 0)
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int cap = per_sm * at::cuda::getDeviceProperties(dev)->multiProcessorCount;
  cache->emplace(key, cap);
  return cap;
#endif
}

// kernel<<<blocks, threads>>>(args...) as a cooperative launch on the current stream: the
// arguments converted to the kernel's parameter types first (the launch copies them by those).
// False, nothing launched and no error left pending, where the driver refuses the cooperative
// launch itself (a grid too large for what this context may use, e.g. under MPS limits, or no
// support): the capacity of `kernel` is then 0 for the rest of the process and the caller takes
// its other path. Any other error throws.
template <typename... KArgs, typename... Args>
bool launch_cooperative(void (*kernel)(KArgs...), int blocks, int threads, Args&&... args) {
#if defined(MESA_CUDA_EMULATION)
  mesa_emu::launch_cooperative(dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)),
                               [&]() { kernel(args...); });
  return true;
#else
  std::tuple<KArgs...> held(std::forward<Args>(args)...);
  cudaError_t err = cudaSuccess;
  std::apply([&](auto&... a) {
    void* ptrs[] = {static_cast<void*>(&a)...};
    err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
                                      dim3(static_cast<unsigned>(blocks)),
                                      dim3(static_cast<unsigned>(threads)), ptrs, 0,
                                      at::cuda::getCurrentCUDAStream());
  }, held);
  if (err == cudaErrorCooperativeLaunchTooLarge || err == cudaErrorNotSupported) {
    (void)cudaGetLastError();  // (clears it)
    coop_refused(reinterpret_cast<const void*>(kernel), threads);
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
#endif
}

}  // namespace
}  // namespace mesa
