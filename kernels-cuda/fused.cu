// CUDA entry points of the Lamport all-reduce fused with residual add + RMSNorm (+ FP8), and
// the unfused baseline's residual + RMSNorm kernel. Bodies and ABI: kernels-common/include/
// allreduce/fused.h (mirrored by crates/gpu/src/abi.rs). Compiled into its own fatbin
// (fused.fatbin), next to allreduce.fatbin. Which instances exist is fused_kernels.inc,
// generated from the kernel table (crates/gpu/src/kernels.rs): one per world size the kernels
// are specialised for (2, 4, 8: rank arrays sized to the world, fewer registers) and one for
// any world (w0: the world from the arguments). The split one-shot is launched with a cluster
// size (cuLaunchKernelEx); it traps below sm_90, where the host never launches it.

#include "allreduce/fused.h"
#include "allreduce/push.h"

using namespace ar;
using namespace ar::fused;

// Two blocks per SM, as for the exact kernels: ranks' grids poll each other's pushes, so all
// of them must be resident at once.
#define AR_KERNEL extern "C" __global__ void __launch_bounds__(kThreads, 2)
#define AR_FUSED_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const FusedKernelArgs a) { __VA_ARGS__(a); }

#include "fused_kernels.inc"
