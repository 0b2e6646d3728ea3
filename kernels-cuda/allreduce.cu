// CUDA entry points of the all-reduce module: the exact one-shot and two-shot kernels (f32,
// f16, bf16), the roofline copy, the quantized two-shot and the codec segment kernels, and the
// hierarchical quantized all-reduce. The bodies, the ABI (struct layouts mirrored by
// crates/gpu/src/abi.rs) and the launch contract are vendor-neutral and live in
// kernels-common/include/allreduce/ (exact.h, quantized.h, hierarchical.h, abi.h); which
// instances exist is allreduce_kernels.inc, generated from the kernel table
// (crates/gpu/src/kernels.rs). kernels-hip/allreduce.hip is this file's HIP twin. Only the
// launch bounds are said here.

#include "allreduce/exact.h"
#include "allreduce/hierarchical.h"
#include "allreduce/quantized.h"

using namespace ar;

// __grid_constant__: the body indexes a.peers with run-time ranks, which would otherwise make
// every thread copy the whole parameter block into local memory at entry.
// Two blocks per SM (<= 64 registers): the ranks' grids spin on each other, so they must all
// be resident at once; with several ranks on one GPU, or other work beside us, one block per
// SM would leave no slack. The price is a few spilled words in two-shot (nvcc 13.0, bytes
// stored: sm_90 f16/bf16 36, f32 4; sm_80 28-36; sm_100 bf16 32); one-shot does not spill.
#define AR_KERNEL extern "C" __global__ void __launch_bounds__(kThreads, 2)
#define AR_ARGS_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const Args a) { __VA_ARGS__(a); }
#define AR_REGISTERED_KERNEL(NAME, ...) \
  AR_KERNEL NAME(AR_GRID_CONSTANT const RegisteredArgs a) { __VA_ARGS__(a); }

#define AR_COPY_KERNEL(NAME) \
  extern "C" __global__ void NAME(const uint4* src, uint4* dst, u64 n_vec) { copy_vectors(src, dst, n_vec); }

// The codec segment kernels: resident 512-thread blocks per SM the encoders / decoders are
// built for (the codec bench and tests launch 4 per SM, grid-stride). Encoders code a block
// per lane (quantized.h, EncodeShape): plain ones fit 64 registers (2 per SM), those with a
// Hadamard candidate (v1 adaptive, v2 integer: kHadamardCodec) need 128 (1 per SM; at 64 they
// spilled). Decoders work in quads: plain ones at 4 per SM (<= 32 registers; at 33-40 only 3
// fit and every SM ran its fourth block in a second wave), Hadamard ones at 2.
template <typename C>
constexpr int kEncodeBlocksPerSm = kHadamardCodec<C> ? 1 : 2;
template <typename C>
constexpr int kDecodeBlocksPerSm = kHadamardCodec<C> ? 2 : 4;
#define AR_ENCODE_KERNEL(NAME, C, ...)                                                  \
  extern "C" __global__ void __launch_bounds__(kThreads, kEncodeBlocksPerSm<C>) NAME( \
      const CodecArgs a) {                                                              \
    __VA_ARGS__(a);                                                                     \
  }
#define AR_DECODE_KERNEL(NAME, C, ...)                                                  \
  extern "C" __global__ void __launch_bounds__(kThreads, kDecodeBlocksPerSm<C>) NAME( \
      const CodecArgs a) {                                                              \
    __VA_ARGS__(a);                                                                     \
  }

#include "allreduce_kernels.inc"
