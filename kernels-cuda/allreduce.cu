// CUDA entry points of the exact one-shot and two-shot all-reduce kernels (f32, f16, bf16)
// and the roofline copy. The bodies, the ABI (struct layouts mirrored by the GPU engine's
// `abi` module) and the launch contract are vendor-neutral and live in
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

// ---- Quantized two-shot and the codec segment kernels (kernels-common quantized.h) ----------
// One instantiation per (element type, codec): the codec is a template parameter, so each
// kernel holds only its own arithmetic. f16 and bf16 only: the codecs carry 16-bit data.
// ENC_MINB / DEC_MINB: resident 512-thread blocks per SM the segment encoders / decoders are
// built for (the codec bench and tests launch 4 per SM, grid-stride). Encoders code a block
// per lane (quantized.h, EncodeShape): plain ones fit 64 registers (2 per SM), adaptive ones
// need 128 (1 per SM; at 64 they spilled). Decoders work in quads: plain ones at 4 per SM
// (<= 32 registers; at 33-40 only 3 fit and every SM ran its fourth block in a second wave),
// adaptive ones at 2.

#include "allreduce/quantized.h"

#define AR_QUANTIZED(CODEC, C, ENC_MINB, DEC_MINB)                                                              \
  AR_KERNEL ar_quantized_f16_##CODEC(AR_GRID_CONSTANT const Args a) {                           \
    quantized_twoshot<ar_half, C>(a);                                                           \
  }                                                                                             \
  AR_KERNEL ar_quantized_bf16_##CODEC(AR_GRID_CONSTANT const Args a) {                          \
    quantized_twoshot<ar_bf16, C>(a);                                                           \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(kThreads, ENC_MINB)                              \
      ar_encode_f32_##CODEC(const CodecArgs a) { encode_segment<float, C>(a); }                 \
  extern "C" __global__ void __launch_bounds__(kThreads, DEC_MINB)                              \
      ar_decode_f32_##CODEC(const CodecArgs a) { decode_segment<float, C>(a); }                 \
  extern "C" __global__ void __launch_bounds__(kThreads, ENC_MINB)                              \
      ar_encode_bf16_##CODEC(const CodecArgs a) { encode_segment<ar_bf16, C>(a); }              \
  extern "C" __global__ void __launch_bounds__(kThreads, DEC_MINB)                              \
      ar_decode_bf16_##CODEC(const CodecArgs a) { decode_segment<ar_bf16, C>(a); }

AR_QUANTIZED(fp8, CodecFp8, 2, 4)
AR_QUANTIZED(q8, CodecQ8, 2, 4)
AR_QUANTIZED(q6, CodecQ6, 2, 4)
AR_QUANTIZED(q4, CodecQ4, 2, 4)
AR_QUANTIZED(q8a, CodecQ8a, 1, 2)
AR_QUANTIZED(q6a, CodecQ6a, 1, 2)
AR_QUANTIZED(q4a, CodecQ4a, 1, 2)

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
