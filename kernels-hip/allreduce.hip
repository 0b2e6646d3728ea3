// HIP entry points of the all-reduce module: the twin of kernels-cuda/allreduce.cu, same
// names, same Args, same bodies (kernels-common/include/allreduce/), the same instance list
// (allreduce_kernels.inc, generated from the kernel table in crates/gpu/src/kernels.rs). Only
// the launch bounds differ.
//
// Header-free (see shim.h): build-support compiles it with -nogpuinc -nogpulib -nostdinc,
// one code object per gfx target (gfx90a, gfx942, and gfx950 when the compiler knows it).

#include "allreduce/exact.h"
#include "allreduce/hierarchical.h"
#include "allreduce/quantized.h"

using namespace ar;

// Two blocks per CU, as on CUDA and for the same reason: the ranks' grids spin on each other,
// so they must all be resident at once, with slack for several ranks on one GPU. A CDNA CU
// runs its waves on 4 SIMDs, so two 512-thread blocks are 2 * 8 waves / 4 = 4 waves per SIMD;
// clang's amdgpu_waves_per_eu(4) caps registers accordingly (gfx90a/gfx942: 512 VGPRs per
// SIMD lane / 4 = 128 per wave, AGPRs included). hip_runtime.h's __launch_bounds__(512, 2)
// would pass the 2 straight through as waves per EU, which is not the CUDA meaning.
// amdgpu_flat_work_group_size(1, kThreads) states the real block size instead of clang's
// default maximum (1024), so the compiler budgets for 8 waves, not 16.
constexpr int kSimdsPerCu = 4;
constexpr int kBlocksPerCu = 2;
constexpr int kWavesPerSimd = kBlocksPerCu * (kThreads / kWarpSize) / kSimdsPerCu;
static_assert(kWavesPerSimd == 4, "two 512-thread blocks of wave64 per CDNA CU");

#define AR_KERNEL                                                                     \
  extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, kThreads), \
                                            amdgpu_waves_per_eu(kWavesPerSimd)))
#define AR_ARGS_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const Args a) { __VA_ARGS__(a); }
#define AR_REGISTERED_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const RegisteredArgs a) { __VA_ARGS__(a); }

#define AR_COPY_KERNEL(NAME) \
  extern "C" __global__ void NAME(const uint4* src, uint4* dst, u64 n_vec) { copy_vectors(src, dst, n_vec); }

// The codec segment kernels. Their quad shuffles are DPP quad_perm moves here (shim:
// quad_xor), so a 64-lane wave runs 16 codec blocks at once.
#define AR_SEGMENT_KERNEL \
  extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, kThreads)))
#define AR_ENCODE_KERNEL(NAME, C, ...) \
  AR_SEGMENT_KERNEL NAME(const CodecArgs a) { __VA_ARGS__(a); }
#define AR_DECODE_KERNEL(NAME, C, ...) \
  AR_SEGMENT_KERNEL NAME(const CodecArgs a) { __VA_ARGS__(a); }

#include "allreduce_kernels.inc"
