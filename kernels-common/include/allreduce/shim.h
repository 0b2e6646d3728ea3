// Portability shim: the only place that knows whether nvcc or HIP clang is compiling.
// Everything else in kernels-common is written against what is defined here.
//
// Provides: AR_DEVICE, AR_HIP, kWarpSize, ar_half / ar_bf16 (16-bit storage types) and their
// f32 conversions, global_timer_ns(), and the three u32 flag accesses the barrier needs:
// st_release_sys, ld_acquire_sys, ld_relaxed_sys, plus load_peer for bulk data.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_DEVICE_COMPILE__) || defined(__HIPCC_RTC__)
#define AR_HIP 1
#else
#define AR_HIP 0
#endif

#if AR_HIP && !defined(__HIPCC_RTC__)  // hiprtc pre-includes both; again would redefine __half
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#endif
// CUDA: no cuda_fp16.h / cuda_bf16.h. They include CCCL's <nv/target>, which the pinned pip
// nvcc lacks (scripts/setup-cuda.sh), and all we need from them is two conversions: single
// PTX instructions, the very ones __float2half_rn and __float2bfloat16_rn emit, written below.

#include <stddef.h>
#include <stdint.h>

#define AR_DEVICE __device__ __forceinline__

// Lets a kernel take the address of a by-value parameter without a per-thread local copy.
#if AR_HIP
#define AR_GRID_CONSTANT
#else
#define AR_GRID_CONSTANT __grid_constant__
#endif

namespace ar {

typedef unsigned long long u64;

#if AR_HIP
constexpr int kWarpSize = 64;  // CDNA wavefronts; nothing in the exact kernels depends on it
#else
constexpr int kWarpSize = 32;
#endif

// 16-bit element types as storage only: kernels compute in f32, so nothing needs the vendor
// classes' arithmetic, and the same tag types work with nvcc, NVRTC, hipcc and hiprtc.
struct ar_half { uint16_t bits; };
struct ar_bf16 { uint16_t bits; };

AR_DEVICE float f16_to_f32(uint16_t h) {
#if AR_HIP
  return __half2float(__ushort_as_half(h));
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

// Round to nearest even; subnormal results are kept (no .ftz).
AR_DEVICE uint16_t f32_to_f16_rn(float f) {
#if AR_HIP
  return __half_as_ushort(__float2half_rn(f));
#else
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// bf16 is the top half of an f32: widening is exact by construction.
AR_DEVICE float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// Round to nearest even. NaN becomes a quiet NaN (CUDA: the canonical 0x7fff; HIP: the
// payload's top bits with the quiet bit set, as the Rust `half` crate does).
AR_DEVICE uint16_t f32_to_bf16_rn(float f) {
#if AR_HIP
  // No bf16 conversion on ROCm 5.2: add half an ulp of the result, plus one more if the kept
  // part is odd, then truncate. A NaN must not carry into infinity, so it is quieted instead.
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));  // sm_80+
  return h;
#endif
}

// Nanoseconds from a clock that ticks the same on every SM, for spin deadlines only.
AR_DEVICE u64 global_timer_ns() {
#if AR_HIP
  // wall_clock64() runs at a fixed 100 MHz on CDNA2/CDNA3 (hipDeviceAttributeWallClockRate);
  // if a part differs, deadlines scale by the same factor, which only stretches a timeout.
  return wall_clock64() * 10ull;
#else
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Flags are only ever touched through these. System scope because the writer may be another
// GPU (NVLink/PCIe peer memory) and the control words live in host memory.
AR_DEVICE void st_release_sys(uint32_t* p, uint32_t v) {
#if AR_HIP
  // The scoped builtin states the scope at the access instead of relying on a separate
  // __threadfence_system; both compile with Debian's hipcc 5.2 (references/toolchain.md).
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

AR_DEVICE uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
#if AR_HIP
  v = __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

// For words that only gate an early exit (the abort word): no ordering needed, just a load
// that is not cached or hoisted out of the spin loop.
AR_DEVICE uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
#if AR_HIP
  v = __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

// Bulk loads of data another rank wrote before a barrier this block has passed. The acquire
// + __syncthreads already orders them (PTX memory model: causality is transitive through the
// CTA barrier), so a plain load would be correct; .cg (L2 only) costs nothing because nothing
// is re-read, and keeps peers' data out of L1 so correctness does not also lean on the
// acquire invalidating L1 for lines another GPU wrote.
AR_DEVICE uint4 load_peer(const uint4* p) {
#if AR_HIP
  // HIP: peer workspaces must be fine-grained (hipDeviceMallocUncached / IPC of such): then
  // a plain load after the acquire is coherent. The allocation side must say so too.
  return *p;
#else
  return __ldcg(p);
#endif
}

}  // namespace ar
