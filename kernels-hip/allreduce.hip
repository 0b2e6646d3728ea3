// HIP entry points of the exact one-shot and two-shot all-reduce kernels (f32, f16, bf16)
// and the roofline copy: the twin of kernels-cuda/allreduce.cu, same names, same Args, same
// bodies (kernels-common/include/allreduce/exact.h). Only the launch bounds differ.
//
// Header-free (see shim.h): build-support compiles it with -nogpuinc -nogpulib -nostdinc,
// one code object per gfx target (gfx90a, gfx942, and gfx950 when the compiler knows it).

#include "allreduce/exact.h"

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
#define AR_KERNELS(SUFFIX, T)                                                                   \
  AR_KERNEL ar_oneshot_##SUFFIX(AR_GRID_CONSTANT const Args a) { oneshot<T>(a); }               \
  AR_KERNEL ar_twoshot_##SUFFIX(AR_GRID_CONSTANT const Args a) { twoshot<T>(a); }

AR_KERNELS(f32, float)
AR_KERNELS(f16, ar_half)
AR_KERNELS(bf16, ar_bf16)

extern "C" __global__ void ar_copy_f32x4(const uint4* src, uint4* dst, u64 n_vec) {
  copy_vectors(src, dst, n_vec);
}

// ---- Quantized two-shot and the codec segment kernels (kernels-common quantized.h) ----------
// The same instantiations as kernels-cuda/allreduce.cu. The codecs' quad shuffles are DPP
// quad_perm moves here (shim: quad_xor), so a 64-lane wave runs 16 codec blocks at once.

#include "allreduce/quantized.h"

#define AR_SEGMENT_KERNEL \
  extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, kThreads)))
#define AR_QUANTIZED(CODEC, C)                                                                  \
  AR_KERNEL ar_quantized_f16_##CODEC(AR_GRID_CONSTANT const Args a) {                           \
    quantized_twoshot<ar_half, C>(a);                                                           \
  }                                                                                             \
  AR_KERNEL ar_quantized_bf16_##CODEC(AR_GRID_CONSTANT const Args a) {                          \
    quantized_twoshot<ar_bf16, C>(a);                                                           \
  }                                                                                             \
  AR_SEGMENT_KERNEL ar_encode_f32_##CODEC(const CodecArgs a) { encode_segment<float, C>(a); }   \
  AR_SEGMENT_KERNEL ar_decode_f32_##CODEC(const CodecArgs a) { decode_segment<float, C>(a); }   \
  AR_SEGMENT_KERNEL ar_encode_bf16_##CODEC(const CodecArgs a) { encode_segment<ar_bf16, C>(a); } \
  AR_SEGMENT_KERNEL ar_decode_bf16_##CODEC(const CodecArgs a) { decode_segment<ar_bf16, C>(a); }

AR_QUANTIZED(fp8, CodecFp8)
AR_QUANTIZED(q8, CodecQ8)
AR_QUANTIZED(q6, CodecQ6)
AR_QUANTIZED(q4, CodecQ4)
AR_QUANTIZED(q8a, CodecQ8a)
AR_QUANTIZED(q6a, CodecQ6a)
AR_QUANTIZED(q4a, CodecQ4a)

// ---- Hierarchical quantized all-reduce, two NUMA groups (kernels-common hierarchical.h) ----
// Templated on the codec like the quantized two-shot, so every codec has one.

#include "allreduce/hierarchical.h"

#define AR_HIERARCHICAL(CODEC, C)                                                               \
  AR_KERNEL ar_hierarchical_f16_##CODEC(AR_GRID_CONSTANT const Args a) {                        \
    hierarchical_quantized<ar_half, C>(a);                                                      \
  }                                                                                             \
  AR_KERNEL ar_hierarchical_bf16_##CODEC(AR_GRID_CONSTANT const Args a) {                       \
    hierarchical_quantized<ar_bf16, C>(a);                                                      \
  }

AR_HIERARCHICAL(fp8, CodecFp8)
AR_HIERARCHICAL(q8, CodecQ8)
AR_HIERARCHICAL(q6, CodecQ6)
AR_HIERARCHICAL(q4, CodecQ4)
AR_HIERARCHICAL(q8a, CodecQ8a)
AR_HIERARCHICAL(q6a, CodecQ6a)
AR_HIERARCHICAL(q4a, CodecQ4a)
