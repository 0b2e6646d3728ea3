// 16-byte vectors and their conversion to and from f32, per element type.
//
// Every kernel moves data as uint4 (one 16-byte load/store per thread) and computes in f32.
// Packed<T> is the only place that knows how T's bits sit in a uint4; the accumulate
// functions in the kernels never see T.
//
// Rounding into T is round-to-nearest-even, once, which is what the host reference does
// (`half::f16::from_f32`, `half::bf16::from_f32`). Finite values and infinities match the
// host bit for bit; NaN bits may not (GPU f32 adds return the canonical NaN).
#pragma once

#include "allreduce/shim.h"

namespace ar {

constexpr int kVecBytes = 16;

template <typename T>
struct Packed;

template <>
struct Packed<float> {
  typedef uint32_t Raw;  // T's bits, for the scalar tail of a buffer
  static constexpr int kElems = kVecBytes / sizeof(float);

  static AR_DEVICE void to_f32(const uint4& v, float (&out)[kElems]) {
    out[0] = as_float(v.x);
    out[1] = as_float(v.y);
    out[2] = as_float(v.z);
    out[3] = as_float(v.w);
  }
  static AR_DEVICE uint4 from_f32(const float (&in)[kElems]) {
    return make_uint4(as_uint(in[0]), as_uint(in[1]), as_uint(in[2]), as_uint(in[3]));
  }
};

// Two 16-bit elements per 32-bit word, the lower address in the low half (little endian).
template <typename T>
struct Packed16 {
  typedef uint16_t Raw;
  static constexpr int kElems = kVecBytes / 2;

  static AR_DEVICE void to_f32(const uint4& v, float (&out)[kElems]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = T::bits_to_f32(static_cast<uint16_t>(w[i] & 0xffffu));
      out[2 * i + 1] = T::bits_to_f32(static_cast<uint16_t>(w[i] >> 16));
    }
  }
  static AR_DEVICE uint4 from_f32(const float (&in)[kElems]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = uint32_t(T::f32_to_bits(in[2 * i])) | (uint32_t(T::f32_to_bits(in[2 * i + 1])) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

struct HalfBits {
  static AR_DEVICE float bits_to_f32(uint16_t b) { return f16_to_f32(b); }
  static AR_DEVICE uint16_t f32_to_bits(float f) { return f32_to_f16_rn(f); }
};

struct Bf16Bits {
  static AR_DEVICE float bits_to_f32(uint16_t b) { return bf16_to_f32(b); }
  static AR_DEVICE uint16_t f32_to_bits(float f) { return f32_to_bf16_rn(f); }
};

template <>
struct Packed<ar_half> : Packed16<HalfBits> {};
template <>
struct Packed<ar_bf16> : Packed16<Bf16Bits> {};

// The tail of a buffer whose byte length is not a multiple of 16: only `count` elements are
// the caller's, so they move one at a time. The rest of the vector is zero (and never stored).
// Unrolled with constant indices so the vector stays in registers.
template <typename T>
AR_DEVICE uint4 load_partial(const void* p, int count) {
  typedef typename Packed<T>::Raw Raw;
  constexpr int kPerWord = 4 / sizeof(Raw), kBits = 8 * sizeof(Raw);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < Packed<T>::kElems; ++i)
    if (i < count)
      w[i / kPerWord] |= uint32_t(static_cast<const Raw*>(p)[i]) << (kBits * (i % kPerWord));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
AR_DEVICE void store_partial(void* p, const uint4& v, int count) {
  typedef typename Packed<T>::Raw Raw;
  constexpr int kPerWord = 4 / sizeof(Raw), kBits = 8 * sizeof(Raw);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < Packed<T>::kElems; ++i)
    if (i < count)
      static_cast<Raw*>(p)[i] = static_cast<Raw>(w[i / kPerWord] >> (kBits * (i % kPerWord)));
}

}  // namespace ar
