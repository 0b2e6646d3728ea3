// CUDA entry points of the exact one-shot and two-shot all-reduce kernels (f32, f16, bf16)
// and the roofline copy. The bodies, the ABI (struct layouts mirrored by
// crates/backend-cuda/src/abi.rs) and the launch contract are vendor-neutral and live in
// kernels-common/include/allreduce/ (exact.h, abi.h); kernels-hip/allreduce.hip is this
// file's HIP twin. Only the names and the launch bounds are said here.

#include "allreduce/exact.h"

using namespace ar;

// __grid_constant__: the body indexes a.peers with run-time ranks, which would otherwise make
// every thread copy the whole parameter block into local memory at entry.
// Two blocks per SM (<= 64 registers): the ranks' grids spin on each other, so they must all
// be resident at once; with several ranks on one GPU, or other work beside us, one block per
// SM would leave no slack. The price is a few spilled words in two-shot (nvcc 13.0, bytes
// stored: sm_90 f16/bf16 36, f32 4; sm_80 28-36; sm_100 bf16 32); one-shot does not spill.
#define AR_KERNEL extern "C" __global__ void __launch_bounds__(kThreads, 2)
#define AR_KERNELS(SUFFIX, T)                                                                   \
  AR_KERNEL ar_oneshot_##SUFFIX(AR_GRID_CONSTANT const Args a) { oneshot<T>(a); }               \
  AR_KERNEL ar_twoshot_##SUFFIX(AR_GRID_CONSTANT const Args a) { twoshot<T>(a); }

AR_KERNELS(f32, float)
AR_KERNELS(f16, ar_half)
AR_KERNELS(bf16, ar_bf16)

extern "C" __global__ void ar_copy_f32x4(const uint4* src, uint4* dst, u64 n_vec) {
  copy_vectors(src, dst, n_vec);
}
