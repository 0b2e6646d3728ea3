// CUDA entry points of the Lamport all-reduce fused with residual add + RMSNorm (+ FP8), and
// the unfused baseline's residual + RMSNorm kernel. Bodies and ABI: kernels-common/include/
// allreduce/fused.h (mirrored by crates/backend-cuda/src/fused.rs). Compiled into its own
// fatbin (fused.fatbin), next to allreduce.fatbin.

#include "allreduce/fused.h"

using namespace ar;
using namespace ar::fused;

// Two blocks per SM, as for the exact kernels: ranks' grids poll each other's pushes, so all
// of them must be resident at once.
#define AR_KERNEL extern "C" __global__ void __launch_bounds__(kThreads, 2)
// One instance per world size the kernels are specialised for (2, 4, 8: rank arrays sized to
// the world, fewer registers) and one for any world (w0: the world from the arguments). The
// split one-shot is launched with a cluster size (cuLaunchKernelEx); it traps below sm_90,
// where the host never launches it.
#define AR_FUSED_WORLD(SUFFIX, T, W)                                                            \
  AR_KERNEL ar_fused_oneshot_##SUFFIX##_w##W(AR_GRID_CONSTANT const FusedKernelArgs a) { oneshot<T, W>(a); } \
  AR_KERNEL ar_fused_twoshot_##SUFFIX##_w##W(AR_GRID_CONSTANT const FusedKernelArgs a) { twoshot<T, W>(a); } \
  AR_KERNEL ar_fused_oneshot_split_##SUFFIX##_w##W(AR_GRID_CONSTANT const FusedKernelArgs a) { oneshot_split<T, W>(a); }
#define AR_FUSED_KERNELS(SUFFIX, T) \
  AR_FUSED_WORLD(SUFFIX, T, 0)      \
  AR_FUSED_WORLD(SUFFIX, T, 2)      \
  AR_FUSED_WORLD(SUFFIX, T, 4)      \
  AR_FUSED_WORLD(SUFFIX, T, 8)      \
  AR_KERNEL ar_rmsnorm_##SUFFIX(AR_GRID_CONSTANT const FusedKernelArgs a) { norm_only<T>(a); }

AR_FUSED_KERNELS(f32, float)
AR_FUSED_KERNELS(f16, ar_half)
AR_FUSED_KERNELS(bf16, ar_bf16)
