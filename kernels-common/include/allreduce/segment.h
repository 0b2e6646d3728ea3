// Every codec behind one interface, and the segment layout they are stored in: encode_quad /
// decode_quad dispatch to the v1 (codec.h) or the v2 (codec_v2.h) coder by the codec type, and
// Segment<C> stores and loads a block's codes and side fields where codec::encode puts them.
// C::Side is what a block's side fields are while in registers: v1 a 16-bit scale field, v2 a
// Side2 (one value per side-field array).
#pragma once

#include "allreduce/codec.h"
#include "allreduce/codec_v2.h"

namespace ar {

// codec::encode_block_with_side: the block's N codes of this lane, packed, and its side fields
// (the same in every lane of the group).
template <typename C, int kN>
AR_DEVICE typename C::Side encode_quad(const float (&x)[kN], int q, Codes<C, kN>& out) {
  if constexpr (C::kV2)
    return encode_v2<C>(x, q, out);
  else
    return encode_v1<C>(x, q, out);
}

// codec::decode_block_with_side, from codes as unpack_codes gives them.
template <typename C, int kN>
AR_DEVICE void decode_quad(const uint32_t (&u)[kN], typename C::Side side, int q, float (&out)[kN]) {
  if constexpr (C::kV2)
    decode_v2<C>(u, side, q, out);
  else
    decode_v1<C>(u, side, q, out);
}

// Codecs whose blocks may be Hadamard-coded (v1 adaptive, v2 integer): their coders cost
// several times a plain one's instructions and registers, which the segment kernels' shapes
// follow (quantized.h, EncodeShape / DecodeShape).
template <typename C>
constexpr bool kHadamardCodec = C::kAdaptiveCodec || (C::kV2 && !C::kFp4);

// Stores / loads of one side field of `kBytes` bytes (a block's fields are aligned to their
// width: each array starts 16-byte aligned).
template <int kBytes>
AR_DEVICE void store_side(char* p, uint32_t v) {
  if constexpr (kBytes == 4)
    *reinterpret_cast<uint32_t*>(p) = v;
  else if constexpr (kBytes == 2)
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
  else
    *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(v);
}
template <int kBytes>
AR_DEVICE uint32_t load_side(const char* p) {
  if constexpr (kBytes == 4)
    return load_peer(reinterpret_cast<const uint32_t*>(p));
  else if constexpr (kBytes == 2)
    return load_peer(reinterpret_cast<const uint16_t*>(p));
  else
    return load_peer(reinterpret_cast<const uint8_t*>(p));
}

// One segment of a codec: `n` elements, the layout of codec::encode.
template <typename C>
struct Segment {
  u64 nb, scales, side1;
  AR_DEVICE explicit Segment(u64 n)
      : nb(blocks_of(n)), scales(scales_offset<C>(n)), side1(scales + align16(C::kSide0 * nb)) {}
  // Block k's side fields (k < nb); the bytes may live on a peer.
  AR_DEVICE typename C::Side load_side_of(const char* base, u64 k) const {
    if constexpr (C::kV2)
      return Side2{load_side<C::kSide0>(base + scales + C::kSide0 * k),
                   load_side<C::kSide1>(base + side1 + C::kSide1 * k)};
    else
      return load_peer(reinterpret_cast<const uint16_t*>(base + scales + 2 * k));
  }
  template <int kN>
  AR_DEVICE void store(char* base, u64 k, int q, const Codes<C, kN>& u, typename C::Side side) const {
    store_codes<C>(base + k * C::kCodeBytes, q, u);
    if (q == 0) {
      if constexpr (C::kV2) {
        store_side<C::kSide0>(base + scales + C::kSide0 * k, side.a);
        store_side<C::kSide1>(base + side1 + C::kSide1 * k, side.b);
      } else {
        *reinterpret_cast<uint16_t*>(base + scales + 2 * k) = side;
      }
    }
  }
  // Block k (k < nb) of a segment that may live on a peer.
  template <int kN>
  AR_DEVICE typename C::Side load(const char* base, u64 k, int q, uint32_t (&u)[kN]) const {
    Codes<C, kN> c;
    load_codes<C>(base + k * C::kCodeBytes, q, c);
    unpack_codes(c, u);
    return load_side_of(base, k);
  }
};

}  // namespace ar
