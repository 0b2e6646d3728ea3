// HIP twin of kernels-cuda/fused.cu: the same bodies (kernels-common/include/allreduce/
// fused.h), the launch bounds of kernels-hip/allreduce.hip. Launched by the ROCm backend
// through allreduce_gpu::fused (Hip::load_fused_module); never yet run on AMD hardware.
// Which instances exist is fused_kernels.inc, generated from the kernel table
// (crates/gpu/src/kernels.rs): only the generic one (w0: the world from the arguments), and no
// split one-shot. The per-world instances of fused.cu would quadruple the compile time (about
// 80 s per target on CI's two cores) for code never yet run on AMD hardware; adding them is
// listing them in the table's Vendor::fused_worlds.

#include "allreduce/fused.h"
#include "allreduce/push.h"

using namespace ar;
using namespace ar::fused;

constexpr int kSimdsPerCu = 4;
constexpr int kBlocksPerCu = 2;
constexpr int kWavesPerSimd = kBlocksPerCu * (kThreads / kWarpSize) / kSimdsPerCu;

#define AR_KERNEL                                                                     \
  extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, kThreads), \
                                            amdgpu_waves_per_eu(kWavesPerSimd)))
#define AR_FUSED_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const FusedKernelArgs a) { __VA_ARGS__(a); }

#include "fused_kernels.inc"
