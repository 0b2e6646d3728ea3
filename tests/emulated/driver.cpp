// The GPU codecs on the CPU: kernels-common/include/allreduce/segment.h (codec.h, codec_v2.h)
// compiled by the host C++ compiler against the host shim (include/allreduce/shim.h), each
// block coded by its group of 32 / N lanes (lanes.h), the way the kernels call it:
//
//   encode: side = encode_quad<C>(x, q, codes); Segment<C>(n).store(dst, k, q, codes, side)
//   decode: side = Segment<C>(n).load(src, k, q, u); decode_quad<C>(u, side, q, out)
//
// tests/tests/codecs_emulated.rs compares the results with the Rust reference
// (allreduce::codec::encode / decode). tests/build.rs compiles this file once per build
// variant: AR_EMU_VARIANT names the exported functions (ar_emu_encode_<variant>, ...),
// AR_EMU_NS the codec source's namespace, AR_EMU_PACK_SAT and AR_EMU_MAX_NAN the shim's
// AR_PACK_SAT and AR_MAX_NAN.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"

#if !defined(AR_EMU_NS) || !defined(AR_EMU_VARIANT)
#error "define AR_EMU_NS and AR_EMU_VARIANT: tests/build.rs does"
#endif

// The codec source's namespace `ar`, renamed per variant: the variants' inline functions of
// the same name differ (kPackSat, scan_amax_quad, ...), and the linker must not merge them.
#define ar AR_EMU_NS
#include "allreduce/segment.h"

#define AR_EMU_CAT2(a, b) a##_##b
#define AR_EMU_CAT(a, b) AR_EMU_CAT2(a, b)
#define AR_EMU_EXPORT(f) AR_EMU_CAT(f, AR_EMU_VARIANT)

// Every codec, numbered by its position in allreduce::Codec::ALL.
#define AR_EMU_CODECS(X) \
  X(0, CodecFp8)         \
  X(1, CodecQ8)          \
  X(2, CodecQ6)          \
  X(3, CodecQ4)          \
  X(4, CodecQ8a)         \
  X(5, CodecQ6a)         \
  X(6, CodecQ4a)         \
  X(7, CodecQ8v2)        \
  X(8, CodecQ6v2)        \
  X(9, CodecQ4v2)        \
  X(10, CodecFp4)

namespace {

using ar::u64;
constexpr int kBlock = 32;

// Segments live in buffers aligned like a GPU allocation, zeroed (the reference zeroes the
// padding; the kernels' callers zero the buffer).
char* alloc_segment(u64 len) {
  const size_t bytes = (size_t(len) + 255) / 256 * 256 + 256;
  char* p = static_cast<char*>(aligned_alloc(256, bytes));
  if (p != nullptr) memset(p, 0, bytes);
  return p;
}

bool same_side(uint16_t a, uint16_t b) { return a == b; }
bool same_side(const ar::Side2& a, const ar::Side2& b) { return a.a == b.a && a.b == b.b; }
void side_str(uint16_t s, char* buf, size_t cap) { snprintf(buf, cap, "0x%04x", unsigned(s)); }
void side_str(const ar::Side2& s, char* buf, size_t cap) {
  snprintf(buf, cap, "{a 0x%08x, b 0x%08x}", unsigned(s.a), unsigned(s.b));
}

template <typename C, int kN>
struct EncodeJob {
  const float* x;
  u64 n;
  char* dst;
  ar::Segment<C> seg;
  typename C::Side* sides;  // [block][lane]
};

template <typename C, int kN>
void encode_lane(void* job, int q) {
  auto& j = *static_cast<EncodeJob<C, kN>*>(job);
  constexpr int kLanes = kBlock / kN;
  for (u64 k = 0; k < j.seg.nb; ++k) {
    ar_emu::set_block(k);
    // Lane q's elements; past n, the tail block's padding is +0.0 (codec::encode).
    float x[kN];
    for (int e = 0; e < kN; ++e) {
      const u64 i = k * kBlock + u64(kN * q + e);
      x[e] = i < j.n ? j.x[i] : 0.0f;
    }
    ar::Codes<C, kN> codes;
    for (uint32_t& w : codes.w) w = 0xA5A5A5A5u;  // a word the packer leaves alone shows up
    const typename C::Side side = ar::encode_quad<C>(x, q, codes);
    j.seg.store(j.dst, k, q, codes, side);
    j.sides[k * kLanes + q] = side;
  }
}

// 0: the segment is in dst. 1: it is, but the lanes of a block returned different side
// fields (the message says which). -1: no result (the message says why).
template <typename C, int kN>
int encode_t(const float* x, u64 n, uint8_t* dst, u64 dst_len, char* err, size_t cap) {
  constexpr int kLanes = kBlock / kN;
  const u64 len = ar::encoded_len<C>(n);
  if (dst_len != len) {
    snprintf(err, cap, "dst is %llu bytes, the codec's encoded_len(%llu) is %llu", (unsigned long long)dst_len,
             (unsigned long long)n, (unsigned long long)len);
    return -1;
  }
  const ar::Segment<C> seg(n);
  char* buf = alloc_segment(len);
  auto* sides = static_cast<typename C::Side*>(calloc(seg.nb * kLanes + 1, sizeof(typename C::Side)));
  if (buf == nullptr || sides == nullptr) {
    free(buf);
    free(sides);
    snprintf(err, cap, "out of memory");
    return -1;
  }
  EncodeJob<C, kN> job{x, n, buf, seg, sides};
  ar_emu::set_segment(buf);
  int rc = ar_emu::run_group(kLanes, encode_lane<C, kN>, &job, err, cap);
  if (rc == 0) {
    memcpy(dst, buf, len);
    for (u64 k = 0; k < seg.nb && rc == 0; ++k) {
      for (int q = 1; q < kLanes; ++q) {
        if (!same_side(sides[k * kLanes + q], sides[k * kLanes])) {
          char a[64], b[64];
          side_str(sides[k * kLanes + q], a, sizeof a);
          side_str(sides[k * kLanes], b, sizeof b);
          snprintf(err, cap,
                   "block %llu: encode_quad returned side fields %s in lane %d but %s in lane 0 (they must "
                   "agree in every lane of the group)",
                   (unsigned long long)k, a, q, b);
          rc = 1;
          break;
        }
      }
    }
  }
  free(sides);
  free(buf);
  return rc;
}

template <typename C, int kN>
struct DecodeJob {
  const char* src;
  u64 n;
  float* out;
  ar::Segment<C> seg;
};

template <typename C, int kN>
void decode_lane(void* job, int q) {
  auto& j = *static_cast<DecodeJob<C, kN>*>(job);
  for (u64 k = 0; k < j.seg.nb; ++k) {
    ar_emu::set_block(k);
    uint32_t u[kN];
    const typename C::Side side = j.seg.load(j.src, k, q, u);
    float out[kN];
    ar::decode_quad<C>(u, side, q, out);
    for (int e = 0; e < kN; ++e) {
      const u64 i = k * kBlock + u64(kN * q + e);
      if (i < j.n) j.out[i] = out[e];
    }
  }
}

template <typename C, int kN>
int decode_t(const uint8_t* src, u64 src_len, u64 n, float* out, char* err, size_t cap) {
  const u64 len = ar::encoded_len<C>(n);
  if (src_len != len) {
    snprintf(err, cap, "src is %llu bytes, the codec's encoded_len(%llu) is %llu", (unsigned long long)src_len,
             (unsigned long long)n, (unsigned long long)len);
    return -1;
  }
  char* buf = alloc_segment(len);
  if (buf == nullptr) {
    snprintf(err, cap, "out of memory");
    return -1;
  }
  memcpy(buf, src, len);
  DecodeJob<C, kN> job{buf, n, out, ar::Segment<C>(n)};
  ar_emu::set_segment(buf);
  const int rc = ar_emu::run_group(kBlock / kN, decode_lane<C, kN>, &job, err, cap);
  free(buf);
  return rc;
}

template <typename C>
int encode_c(int lanes_n, const float* x, u64 n, uint8_t* dst, u64 dst_len, char* err, size_t cap) {
  switch (lanes_n) {
    case 8:
      return encode_t<C, 8>(x, n, dst, dst_len, err, cap);
    case 16:
      return encode_t<C, 16>(x, n, dst, dst_len, err, cap);
    case 32:
      return encode_t<C, 32>(x, n, dst, dst_len, err, cap);
  }
  snprintf(err, cap, "encode takes 8, 16 or 32 elements per lane, not %d", lanes_n);
  return -1;
}

template <typename C>
int decode_c(int lanes_n, const uint8_t* src, u64 src_len, u64 n, float* out, char* err, size_t cap) {
  // load_codes: decoders work in quads (8) or pairs (16).
  switch (lanes_n) {
    case 8:
      return decode_t<C, 8>(src, src_len, n, out, err, cap);
    case 16:
      return decode_t<C, 16>(src, src_len, n, out, err, cap);
  }
  snprintf(err, cap, "decode takes 8 or 16 elements per lane, not %d", lanes_n);
  return -1;
}

}  // namespace

extern "C" {

// Encodes x[0..n) with codec `codec` (its index in Codec::ALL), `lanes_n` elements per lane,
// into dst (dst_len must be the codec's encoded_len(n)). Returns as encode_t.
int AR_EMU_EXPORT(ar_emu_encode)(int codec, int lanes_n, const float* x, uint64_t n, uint8_t* dst,
                                 uint64_t dst_len, char* err, uint64_t err_cap) {
  switch (codec) {
#define AR_EMU_CASE(i, T) \
  case i:                 \
    return encode_c<ar::T>(lanes_n, x, n, dst, dst_len, err, err_cap);
    AR_EMU_CODECS(AR_EMU_CASE)
#undef AR_EMU_CASE
  }
  snprintf(err, err_cap, "no codec %d", codec);
  return -1;
}

// Decodes the n elements of src (src_len bytes, the codec's encoded_len(n)) into out.
// Returns 0, or -1 with a message.
int AR_EMU_EXPORT(ar_emu_decode)(int codec, int lanes_n, const uint8_t* src, uint64_t src_len, uint64_t n,
                                 float* out, char* err, uint64_t err_cap) {
  switch (codec) {
#define AR_EMU_CASE(i, T) \
  case i:                 \
    return decode_c<ar::T>(lanes_n, src, src_len, n, out, err, err_cap);
    AR_EMU_CODECS(AR_EMU_CASE)
#undef AR_EMU_CASE
  }
  snprintf(err, err_cap, "no codec %d", codec);
  return -1;
}

// The codec's layout as the codec source has it: layout[0] code bytes per block, layout[1]
// and layout[2] the bytes per block of side-field arrays 0 and 1 (0: no such array).
int AR_EMU_EXPORT(ar_emu_layout)(int codec, uint32_t* layout) {
  switch (codec) {
#define AR_EMU_CASE(i, T)         \
  case i:                         \
    layout[0] = ar::T::kCodeBytes; \
    layout[1] = ar::T::kSide0;     \
    layout[2] = ar::T::kSide1;     \
    return 0;
    AR_EMU_CODECS(AR_EMU_CASE)
#undef AR_EMU_CASE
  }
  return -1;
}

}  // extern "C"
