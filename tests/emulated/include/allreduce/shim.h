// Host stand-in for kernels-common/include/allreduce/shim.h: what codec.h, codec_v2.h and
// segment.h use from the vendor shim, in plain C++17 on the CPU, so that the GPU codec source
// compiles with the host compiler and runs in tests/emulated/driver.cpp. This directory comes
// first on the include path, so `#include "allreduce/shim.h"` finds this file.
//
// It emulates CUDA (AR_HIP 0) without FP8 hardware (AR_HW_E4M3 0). AR_PACK_SAT and AR_MAX_NAN
// come from the build (AR_EMU_PACK_SAT, AR_EMU_MAX_NAN): 1 and 1 is what sm_90 takes, 0 and 0
// the portable paths. Every intrinsic below is the IEEE f32 operation of the same meaning;
// the build passes -ffp-contract=off so that nothing is fused into an FMA.
//
// Lane shuffles (__shfl_xor_sync) go to tests/emulated/lanes.cpp, which runs the lanes of a
// group as fibers in lockstep.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(AR_EMU_PACK_SAT) || !defined(AR_EMU_MAX_NAN)
#error "define AR_EMU_PACK_SAT and AR_EMU_MAX_NAN (0 or 1): tests/build.rs does"
#endif

#define AR_HIP 0
#define AR_DEVICE inline
#define AR_GRID_CONSTANT
#define AR_PACK_SAT AR_EMU_PACK_SAT
#define AR_MAX_NAN AR_EMU_MAX_NAN
#define AR_HW_E4M3 0

// ---- The emulated lane group (lanes.cpp) ----------------------------------------------------

extern "C" {
// The value `v` of lane (this lane ^ lane_mask) of the current group, every lane calling
// together.
uint32_t ar_emu_shfl_xor(uint32_t v, int lane_mask);
// Records a fault of the running lane (misaligned access); the run reports it.
void ar_emu_fault(const char* what, const void* p, unsigned align);
}

// ---- CUDA intrinsics, as their IEEE f32 operations ------------------------------------------

inline uint32_t __shfl_xor_sync(unsigned mask, uint32_t v, int lane_mask) {
  if (mask != 0xffffffffu) ar_emu_fault("__shfl_xor_sync with a partial mask", nullptr, 0);
  return ar_emu_shfl_xor(v, lane_mask);
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }

namespace ar {

typedef unsigned long long u64;
constexpr int kWarpSize = 32;

// 8- and 16-byte vectors as CUDA's: aligned to their size. A store through a misaligned one
// (a fault on the GPU) is reported instead of done.
struct alignas(8) uint2 {
  uint2() = default;
  uint2(const uint2&) = default;
  uint32_t x, y;
  uint2& operator=(const uint2& o) {
    if (reinterpret_cast<uintptr_t>(this) % 8 != 0) {
      ar_emu_fault("misaligned uint2 store", this, 8);
      return *this;
    }
    x = o.x;
    y = o.y;
    return *this;
  }
};
struct alignas(16) uint4 {
  uint4() = default;
  uint4(const uint4&) = default;
  uint32_t x, y, z, w;
  uint4& operator=(const uint4& o) {
    if (reinterpret_cast<uintptr_t>(this) % 16 != 0) {
      ar_emu_fault("misaligned uint4 store", this, 16);
      return *this;
    }
    x = o.x;
    y = o.y;
    z = o.z;
    w = o.w;
    return *this;
  }
};
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 is the 16-byte I/O unit");
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "uint2 is the 8-byte I/O unit");
AR_DEVICE uint2 make_uint2(uint32_t x, uint32_t y) {
  uint2 r;
  r.x = x;
  r.y = y;
  return r;
}
AR_DEVICE uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  uint4 r;
  r.x = x;
  r.y = y;
  r.z = z;
  r.w = w;
  return r;
}

AR_DEVICE float as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
AR_DEVICE uint32_t as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
AR_DEVICE u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// Plain loads (the GPU's .cg loads), each checked for its natural alignment.
template <typename V>
AR_DEVICE V load_peer_checked(const V* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(V) != 0) {
    ar_emu_fault(what, p, alignof(V));
    return V{};
  }
  return *p;
}
AR_DEVICE uint4 load_peer(const uint4* p) { return load_peer_checked(p, "misaligned uint4 load"); }
AR_DEVICE uint2 load_peer(const uint2* p) { return load_peer_checked(p, "misaligned uint2 load"); }
AR_DEVICE uint32_t load_peer(const uint32_t* p) { return load_peer_checked(p, "misaligned u32 load"); }
AR_DEVICE uint16_t load_peer(const uint16_t* p) { return load_peer_checked(p, "misaligned u16 load"); }
AR_DEVICE uint8_t load_peer(const uint8_t* p) { return *p; }

// max.NaN.f32: a NaN if either operand is one (PTX gives the canonical 0x7FFFFFFF), else the
// larger.
#if AR_MAX_NAN
AR_DEVICE float max_nan(float a, float b) {
  if (a != a || b != b) return as_float(0x7FFFFFFFu);
  return a > b ? a : b;
}
#endif

// cvt.pack.sat.u4/u8.s32.b32: d = rest << 2k | sat(hi) << k | sat(lo), as the vendor shim's
// portable versions (exact).
AR_DEVICE uint32_t pack_sat_bits(int32_t v, int32_t top) { return uint32_t(v < 0 ? 0 : (v > top ? top : v)); }
AR_DEVICE uint32_t pack_sat_u4(int32_t hi, int32_t lo, uint32_t rest) {
  return (rest << 8) | (pack_sat_bits(hi, 15) << 4) | pack_sat_bits(lo, 15);
}
AR_DEVICE uint32_t pack_sat_u8(int32_t hi, int32_t lo, uint32_t rest) {
  return (rest << 16) | (pack_sat_bits(hi, 255) << 8) | pack_sat_bits(lo, 255);
}

// __vimax3_s32 / __vimax3_u32 / __vimin3_u32 (DPX on sm_90): the largest or smallest of three.
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

// __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of the pair (a = bytes 0-3,
// b = bytes 4-7).
AR_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  const u64 pair = (u64)b << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((pair >> (8 * ((sel >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
}

}  // namespace ar
