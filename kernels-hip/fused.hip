// HIP twin of kernels-cuda/fused.cu: the same bodies (kernels-common/include/allreduce/
// fused.h), the launch bounds of kernels-hip/allreduce.hip. Launched by the ROCm backend
// through allreduce_core::gpu::fused (Hip::load_fused_module); never yet run on AMD hardware.

#include "allreduce/fused.h"

using namespace ar;
using namespace ar::fused;

constexpr int kSimdsPerCu = 4;
constexpr int kBlocksPerCu = 2;
constexpr int kWavesPerSimd = kBlocksPerCu * (kThreads / kWarpSize) / kSimdsPerCu;

#define AR_KERNEL                                                                     \
  extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, kThreads), \
                                            amdgpu_waves_per_eu(kWavesPerSimd)))
// Only the generic instance (w0: the world from the arguments): the per-world instances of
// fused.cu would quadruple the compile time (about 80 s per target on CI's two cores) for code
// never yet run on AMD hardware. Adding them means listing them in Hip::FUSED_WORLDS
// (backend-rocm's kernels test checks the two agree).
#define AR_FUSED_WORLD(SUFFIX, T, W)                                                            \
  AR_KERNEL ar_fused_oneshot_##SUFFIX##_w##W(AR_GRID_CONSTANT const FusedKernelArgs a) { oneshot<T, W>(a); } \
  AR_KERNEL ar_fused_twoshot_##SUFFIX##_w##W(AR_GRID_CONSTANT const FusedKernelArgs a) { twoshot<T, W>(a); }
#define AR_FUSED_KERNELS(SUFFIX, T) \
  AR_FUSED_WORLD(SUFFIX, T, 0)      \
  AR_KERNEL ar_rmsnorm_##SUFFIX(AR_GRID_CONSTANT const FusedKernelArgs a) { norm_only<T>(a); }

AR_FUSED_KERNELS(f32, float)
AR_FUSED_KERNELS(f16, ar_half)
AR_FUSED_KERNELS(bf16, ar_bf16)
