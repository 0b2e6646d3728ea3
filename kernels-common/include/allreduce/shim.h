// Portability shim: the only place that knows whether nvcc or HIP clang is compiling.
// Everything else in kernels-common is written against what is defined here.
//
// Provides: AR_DEVICE, AR_HIP, AR_GRID_CONSTANT, kWarpSize, ar_half / ar_bf16 (16-bit storage
// types) and their f32 conversions, the index accessors (thread_x, block_x, block_dim_x,
// grid_dim_x), block barriers (sync_block, sync_block_or), uint4 / make_uint4, as_float /
// as_uint, min_u64, fence_system, cas_sys, global_timer_ns(), and the three u32 flag accesses
// the barrier needs: st_release_sys, ld_acquire_sys, ld_relaxed_sys, plus load_peer for bulk
// data. On CUDA each is the CUDA built-in of the same meaning, so the generated code is what
// the CUDA spelling would give.
//
// HIP is header-free: kernels-hip is compiled with -nogpuinc -nogpulib -nostdinc (build-support
// passes them), so nothing below may come from hip_runtime.h, the ROCm device libraries or
// libc; it is clang builtins only. The compilers that know gfx942/gfx950 without a ROCm
// install (scripts/setup-hip.sh) ship none of those, and the kernels need only a dozen things.
// hiprtc and hipcc's implicit hip_runtime.h are therefore not supported: the guard below says
// so instead of failing on a redefinition deep inside a vendor header.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_DEVICE_COMPILE__) || defined(__HIPCC_RTC__) || \
    defined(__HIP__)
#define AR_HIP 1
#else
#define AR_HIP 0
#endif

#if AR_HIP
#if defined(__HIPCC_RTC__) || defined(HIP_INCLUDE_HIP_HIP_RUNTIME_H) || \
    defined(__CLANG_HIP_RUNTIME_WRAPPER_H__)
#error "kernels-common is header-free on HIP: compile with -nogpuinc -nogpulib (build-support does)"
#endif
#if !defined(__AMDGCN__) && defined(__HIP_DEVICE_COMPILE__)
#error "HIP device code is only written for AMDGPU (amdgcn) targets"
#endif
// What hip_runtime.h would define, the way clang's own HIP wrapper spells it.
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __forceinline__ inline __attribute__((always_inline))
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __INT32_TYPE__ int32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
#ifndef offsetof
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif
#else
// CUDA: no cuda_fp16.h / cuda_bf16.h. They include CCCL's <nv/target>, which the pinned pip
// nvcc lacks (scripts/setup-cuda.sh), and all we need from them is two conversions: single
// PTX instructions, the very ones __float2half_rn and __float2bfloat16_rn emit, written below.
#include <stddef.h>
#include <stdint.h>
#endif

#define AR_DEVICE __device__ __forceinline__

// Lets a kernel take the address of a by-value parameter without a per-thread local copy.
// HIP needs nothing: clang passes a by-value struct to an AMDGPU kernel by reference into the
// kernarg segment, so run-time indexing (a.peers[peer]) reads it in place.
#if AR_HIP
#define AR_GRID_CONSTANT
#else
#define AR_GRID_CONSTANT __grid_constant__
#endif

namespace ar {

typedef unsigned long long u64;

#if AR_HIP
// CDNA wavefronts. Nothing in the exact kernels depends on it: their only per-lane logic is
// "threads 0..world-1 talk to one peer each" (world <= 8, always inside the first wave), and
// block-wide agreement goes through sync_block_or, not through warp votes or shuffles.
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif

// ---- Indices and block barriers --------------------------------------------------------------

#if AR_HIP
AR_DEVICE unsigned thread_x() { return __builtin_amdgcn_workitem_id_x(); }
AR_DEVICE unsigned block_x() { return __builtin_amdgcn_workgroup_id_x(); }
AR_DEVICE unsigned block_dim_x() { return __builtin_amdgcn_workgroup_size_x(); }
// The dispatch packet holds the grid in work-items, not blocks; HIP launches whole blocks, so
// the division is exact. Computed once per kernel (the compiler hoists it out of the loops).
// (Not hidden_block_count_x from the implicit kernel arguments: that layout depends on the
// code object version, the dispatch packet's does not.)
AR_DEVICE unsigned grid_dim_x() { return __builtin_amdgcn_grid_size_x() / block_dim_x(); }

// __syncthreads as HIP spells it: the barrier alone does not order memory on AMDGPU, so it is
// wrapped in workgroup-scope release/acquire fences.
AR_DEVICE void sync_block() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// __syncthreads_or without the device libraries: one LDS word, three barriers (clear; vote;
// read; the last keeps the next call's clear from overtaking a slow reader). Only spin-free
// barrier paths use it, a few times per kernel, so the two extra barriers cost nothing that
// matters. The first barrier orders memory like sync_block, as __syncthreads_or does.
AR_DEVICE int sync_block_or(int pred) {
  __shared__ uint32_t any;  // one word per kernel: every inlined copy names the same variable
  if (thread_x() == 0) any = 0;
  sync_block();
  if (pred) __hip_atomic_store(&any, 1u, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
  sync_block();
  const int r = any != 0;
  sync_block();
  return r;
}
#else
AR_DEVICE unsigned thread_x() { return threadIdx.x; }
AR_DEVICE unsigned block_x() { return blockIdx.x; }
AR_DEVICE unsigned block_dim_x() { return blockDim.x; }
AR_DEVICE unsigned grid_dim_x() { return gridDim.x; }
AR_DEVICE void sync_block() { __syncthreads(); }
AR_DEVICE int sync_block_or(int pred) { return __syncthreads_or(pred); }
#endif

// ---- 16-byte vectors and bit casts -----------------------------------------------------------

#if AR_HIP
// A native 4 x u32 vector: one global_load/store_dwordx4 per access, and .x/.y/.z/.w like
// CUDA's struct.
typedef uint32_t uint4 __attribute__((ext_vector_type(4)));
typedef uint32_t uint2 __attribute__((ext_vector_type(2)));
AR_DEVICE uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  return uint4{x, y, z, w};
}
AR_DEVICE uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
AR_DEVICE float as_float(uint32_t u) { return __builtin_bit_cast(float, u); }
AR_DEVICE uint32_t as_uint(float f) { return __builtin_bit_cast(uint32_t, f); }
AR_DEVICE u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }
#else
using ::make_uint2;
using ::make_uint4;
using ::uint2;
using ::uint4;
AR_DEVICE float as_float(uint32_t u) { return __uint_as_float(u); }
AR_DEVICE uint32_t as_uint(float f) { return __float_as_uint(f); }
AR_DEVICE u64 min_u64(u64 a, u64 b) { return ::min(a, b); }
#endif
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 is the 16-byte I/O unit");

// ---- 16-bit element types --------------------------------------------------------------------

// 16-bit element types as storage only: kernels compute in f32, so nothing needs the vendor
// classes' arithmetic, and the same tag types work with nvcc, NVRTC and header-free HIP clang.
struct ar_half { uint16_t bits; };
struct ar_bf16 { uint16_t bits; };

AR_DEVICE float f16_to_f32(uint16_t h) {
#if AR_HIP
  return static_cast<float>(__builtin_bit_cast(_Float16, h));  // v_cvt_f32_f16: exact
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

// Round to nearest even; subnormal results are kept (no .ftz).
AR_DEVICE uint16_t f32_to_f16_rn(float f) {
#if AR_HIP
  // v_cvt_f16_f32 under the default mode: nearest even, f16 denormals kept. build-support
  // passes -fno-gpu-flush-denormals-to-zero so f32 denormal inputs are not flushed either.
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#else
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// bf16 is the top half of an f32: widening is exact by construction.
AR_DEVICE float bf16_to_f32(uint16_t h) { return as_float(uint32_t(h) << 16); }

// Round to nearest even. NaN becomes a quiet NaN (CUDA: the canonical 0x7fff; HIP: the
// payload's top bits with the quiet bit set, as the Rust `half` crate does).
AR_DEVICE uint16_t f32_to_bf16_rn(float f) {
#if AR_HIP
  // Integer rounding, so it is the same on every gfx target (gfx950 has a bf16 convert,
  // gfx90a/gfx942 do not): add half an ulp of the result, plus one more if the kept part is
  // odd, then truncate. A NaN must not carry into infinity, so it is quieted instead.
  const uint32_t u = as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));  // sm_80+
  return h;
#endif
}

// max(a, b) that returns NaN when either is NaN (the FP8 block scan). AR_MAX_NAN: the target
// has it as one instruction (PTX max.NaN.f32, sm_80+).
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define AR_MAX_NAN 1
AR_DEVICE float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
#else
#define AR_MAX_NAN 0
#endif

// Three-way integer maxima and minima: one instruction on sm_90 (DPX's VIMNMX3),
// two compares elsewhere. The codecs take maxima of f32 bit patterns with them (codec_v2.h,
// balanced_scale).
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
AR_DEVICE int32_t max3_s32(int32_t a, int32_t b, int32_t c) { return __vimax3_s32(a, b, c); }
AR_DEVICE uint32_t max3_u32(uint32_t a, uint32_t b, uint32_t c) { return __vimax3_u32(a, b, c); }
AR_DEVICE uint32_t min3_u32(uint32_t a, uint32_t b, uint32_t c) { return __vimin3_u32(a, b, c); }
#else
AR_DEVICE int32_t max3_s32(int32_t a, int32_t b, int32_t c) {
  const int32_t m = a > b ? a : b;
  return m > c ? m : c;
}
AR_DEVICE uint32_t max3_u32(uint32_t a, uint32_t b, uint32_t c) {
  const uint32_t m = a > b ? a : b;
  return m > c ? m : c;
}
AR_DEVICE uint32_t min3_u32(uint32_t a, uint32_t b, uint32_t c) {
  const uint32_t m = a < b ? a : b;
  return m < c ? m : c;
}
#endif

// Programmatic dependent launch (PTX griddepcontrol, sm_90+). A kernel launched with the
// programmatic-serialization attribute may be scheduled before the stream's previous kernel
// has finished: pdl_wait() holds it until that kernel has completed and its memory is
// visible, so it must come before the first global access. pdl_trigger() lets the next
// kernel of the stream be scheduled early; without the attribute both are no-ops, and on
// HIP (no such launch) they compile to nothing.
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
AR_DEVICE void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
AR_DEVICE void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#else
AR_DEVICE void pdl_wait() {}
AR_DEVICE void pdl_trigger() {}
#endif

// AR_PACK_SAT: the target clamps two s32 to 4 or 8 unsigned bits and packs them above the low
// bits of a third word in one instruction (PTX cvt.pack.sat, sm_72+): d = rest << 2k | sat(hi)
// << k | sat(lo). The q4, q6 and adaptive encoders clamp and pack their codes with it
// (codec.h, kPackSat).
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 720
#define AR_PACK_SAT 1
AR_DEVICE uint32_t pack_sat_u4(int32_t hi, int32_t lo, uint32_t rest) {
  uint32_t d;
  asm("cvt.pack.sat.u4.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(hi), "r"(lo), "r"(rest));
  return d;
}
AR_DEVICE uint32_t pack_sat_u8(int32_t hi, int32_t lo, uint32_t rest) {
  uint32_t d;
  asm("cvt.pack.sat.u8.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(hi), "r"(lo), "r"(rest));
  return d;
}
#else
// The same results by clamps and shifts, so the codec source compiles everywhere; the codecs
// keep their clamp-per-code path where AR_PACK_SAT is 0 (kPackSat) and do not call these.
#define AR_PACK_SAT 0
AR_DEVICE uint32_t pack_sat_bits(int32_t v, int32_t top) { return uint32_t(v < 0 ? 0 : (v > top ? top : v)); }
AR_DEVICE uint32_t pack_sat_u4(int32_t hi, int32_t lo, uint32_t rest) {
  return (rest << 8) | (pack_sat_bits(hi, 15) << 4) | pack_sat_bits(lo, 15);
}
AR_DEVICE uint32_t pack_sat_u8(int32_t hi, int32_t lo, uint32_t rest) {
  return (rest << 16) | (pack_sat_bits(hi, 255) << 8) | pack_sat_bits(lo, 255);
}
#endif

// Byte i of the result is byte (sel >> 4i) & 7 of the pair (a = bytes 0-3, b = bytes 4-7): CUDA's
// __byte_perm (one PRMT). HIP: the same bytes by shifts (v_perm_b32 numbers its bytes the
// other way round; the codec packers that use this are measured on CUDA only).
AR_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if AR_HIP
  const unsigned long long pair = (unsigned long long)b << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((pair >> (8 * ((sel >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
#else
  return __byte_perm(a, b, sel);
#endif
}

// ---- FP8 E4M3 (OCP "fn") conversions in hardware ---------------------------------------------

// AR_HW_E4M3: the target converts f32 <-> OCP E4M3 in one instruction (CUDA sm_89+:
// cvt.rn.satfinite.e4m3x2.f32 and cvt.rn.f16x2.e4m3x2). The codecs use it where its results
// are the format's (codec.h says how); elsewhere, HIP included (gfx942's FP8 is E4M3FNUZ, a
// different format), they use their integer conversions.
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define AR_HW_E4M3 1
// Codes of two f32 in the low 16 bits, `lo` in the low byte: nearest even from the f32 value,
// subnormals included, magnitudes beyond 448 (and infinities) saturated to +-448, NaN -> 0x7F.
// A negative value that rounds to zero gives 0x80.
AR_DEVICE uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// Two codes (low byte first) to f16x2 (low half first): exact, every E4M3 value is an f16.
AR_DEVICE uint32_t cvt_e4m3x2_to_f16x2(uint32_t codes) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<uint16_t>(codes)));
  return r;
}
#else
#define AR_HW_E4M3 0
#endif

// ---- Clock, fences, atomics ------------------------------------------------------------------

// Nanoseconds from a clock that ticks the same on every SM, for spin deadlines only.
AR_DEVICE u64 global_timer_ns() {
#if AR_HIP
  // s_memrealtime (what HIP's wall_clock64() is on gfx9) runs at a fixed 100 MHz on
  // CDNA2/CDNA3 (hipDeviceAttributeWallClockRate); if a part differs, deadlines scale by the
  // same factor, which only stretches a timeout. volatile in effect: the builtin is not
  // hoisted out of the spin loop.
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// __threadfence_system: orders this thread's earlier writes before its later ones for every
// observer, host and peer GPUs included.
AR_DEVICE void fence_system() {
#if AR_HIP
  __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "");  // "" is the system scope
#else
  __threadfence_system();
#endif
}

// atomicCAS_system: relaxed compare-and-swap visible to the host and peers; returns the old
// value.
AR_DEVICE uint32_t cas_sys(uint32_t* p, uint32_t expected, uint32_t desired) {
#if AR_HIP
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;  // on failure the builtin wrote the value it found; on success it is unchanged
#else
  return atomicCAS_system(p, expected, desired);
#endif
}

// Flags are only ever touched through these. System scope because the writer may be another
// GPU (NVLink/PCIe/xGMI peer memory) and the control words live in host memory.
AR_DEVICE void st_release_sys(uint32_t* p, uint32_t v) {
#if AR_HIP
  // The scoped builtin states the scope at the access instead of relying on a separate
  // fence_system.
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

// Relaxed system-scope stores and 64-bit loads: for words that carry their own proof of
// freshness (the registered kernels' tagged descriptors, exact.h), so that no release has to
// order them after anything. A 64-bit aligned access is single-copy atomic on both vendors.
AR_DEVICE void st_relaxed_sys(uint32_t* p, uint32_t v) {
#if AR_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

AR_DEVICE void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
#if AR_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

AR_DEVICE unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  unsigned long long v;
#if AR_HIP
  v = __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#endif
  return v;
}

// Bulk loads of data another rank wrote before a barrier this block has passed. The acquire
// + __syncthreads already orders them (PTX memory model: causality is transitive through the
// CTA barrier), so a plain load would be correct; .cg (L2 only) costs nothing because nothing
// is re-read, and keeps peers' data out of L1 so correctness does not also lean on the
// acquire invalidating L1 for lines another GPU wrote.
// HIP: peer workspaces must be fine-grained (hipDeviceMallocUncached / IPC of such): then a
// plain load after the acquire is coherent. The allocation side must say so too.
// The narrower overloads serve the codecs' packed codes and scales.
#if AR_HIP
template <typename V>
AR_DEVICE V load_peer(const V* p) {
  return *p;
}
#else
AR_DEVICE uint4 load_peer(const uint4* p) { return __ldcg(p); }
AR_DEVICE uint2 load_peer(const uint2* p) { return __ldcg(p); }
AR_DEVICE uint32_t load_peer(const uint32_t* p) { return __ldcg(p); }
AR_DEVICE uint16_t load_peer(const uint16_t* p) { return __ldcg(p); }
AR_DEVICE uint8_t load_peer(const uint8_t* p) { return __ldcg(p); }
#endif

}  // namespace ar
