// The quantized two-shot all-reduce (QuickReduce's AllReduceTwoshot<T, Codec> shape) and the
// segment encode/decode kernels the codec tests and benchmark use. Bodies only; the entry
// points are in kernels-cuda/allreduce.cu and kernels-hip/allreduce.hip.
//
// Algorithm (the host backend's, crates/backend-host, step for step, so both give the same
// bytes):
//   1. every rank encodes its piece of shard j and pushes it into owner j's staging, slot
//      `rank` (j != rank);                                            barrier (+ agreement)
//   2. the owner decodes the world-1 pieces, adds its own piece unquantized, sums in f32 in
//      rank order, encodes the sum once and pushes the bytes into every rank's `reduced`,
//      slot `owner`;                                                   barrier
//   3. every rank decodes every slot of its own `reduced` into the output.
// Every rank decodes the very same bytes in step 3, so the outputs are bitwise identical.
// Pushing (remote stores) rather than pulling keeps step 3's reads local and lets stores over
// NVLink/xGMI stream without a round trip per load.
//
// Shards are whole codec blocks (allreduce_core::layout, QUANT_GRANULE = 32 elements): shard
// j is elements [j*S, min((j+1)*S, n)), S = ceil(ceil(n/32)/world)*32, so the codec blocks are
// the buffer's global blocks. Each slot holds one segment in the codec's layout (docs/codecs.md,
// "Segment layout") for the shard's length; slots are `slot_bytes = encoded_len(S)` apart.
// The host checks world * slot_bytes <= max_bytes.
//
// Block classes and buffer reuse, as in exact.h: codec block k of any shard is handled by CTA
// (k / kQuadsPerCta) % G in every phase and on every rank, so the per-CTA barrier suffices.
// Staging is indexed by call parity like the exact kernels' (a one-shot call just before may
// still be read); a peer writes our staging[p] in phase 1 of call c only after every rank
// passed call c-1's last barrier, hence after we decoded what it wrote in call c-2 into the
// same parity. `reduced` is written in phase 2 of call c, after barrier 1 of call c, which no
// rank passes before every rank finished phase 3 of call c-1.
#pragma once

#include "allreduce/codec.h"
#include "allreduce/exact.h"

namespace ar {

constexpr int kQuadsPerCta = kThreads / kQuad;  // 128 codec blocks per CTA pass

// Eight consecutive elements [e0, e0 + 8) of T as f32, zeros at and past `end`.
template <typename T>
AR_DEVICE void load8(const void* base, u64 e0, u64 end, float (&x)[kPerLane]) {
  constexpr int E = Packed<T>::kElems;
  const char* p = static_cast<const char*>(base);
#pragma unroll
  for (int v = 0; v < kPerLane / E; ++v) {
    const u64 s = e0 + u64(v) * E;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (s + E <= end)
      raw = *reinterpret_cast<const uint4*>(p + s * sizeof(T));
    else if (s < end)
      raw = load_partial<T>(p + s * sizeof(T), int(end - s));
    float f[E];
    Packed<T>::to_f32(raw, f);
#pragma unroll
    for (int i = 0; i < E; ++i) x[v * E + i] = f[i];
  }
}

// Rounds x into T (nearest even) and stores the elements of [e0, e0 + 8) below `end`.
template <typename T>
AR_DEVICE void store8(void* base, u64 e0, u64 end, const float (&x)[kPerLane]) {
  constexpr int E = Packed<T>::kElems;
  char* p = static_cast<char*>(base);
#pragma unroll
  for (int v = 0; v < kPerLane / E; ++v) {
    const u64 s = e0 + u64(v) * E;
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = x[v * E + i];
    const uint4 raw = Packed<T>::from_f32(f);
    if (s + E <= end)
      *reinterpret_cast<uint4*>(p + s * sizeof(T)) = raw;
    else if (s < end)
      store_partial<T>(p + s * sizeof(T), raw, int(end - s));
  }
}

// One segment of a codec: `n` elements, the layout of codec::encode.
template <typename C>
struct Segment {
  u64 nb, scales;
  AR_DEVICE explicit Segment(u64 n) : nb(blocks_of(n)), scales(scales_offset<C>(n)) {}
  AR_DEVICE void store(char* base, u64 k, int q, const uint32_t (&u)[kPerLane],
                       uint16_t field) const {
    store_codes<C>(base + k * C::kCodeBytes, q, u);
    if (q == 0) *reinterpret_cast<uint16_t*>(base + scales + 2 * k) = field;
  }
  // Block k (k < nb) of a segment that may live on a peer.
  AR_DEVICE uint16_t load(const char* base, u64 k, int q, uint32_t (&u)[kPerLane]) const {
    load_codes<C>(base + k * C::kCodeBytes, q, u);
    return load_peer(reinterpret_cast<const uint16_t*>(base + scales + 2 * k));
  }
};

// Loop over codec blocks [0, nb) by quads, grid-stride. The bound is tested on the warp's
// first quad so whole warps iterate together (the codec functions shuffle); `k` may be past
// nb for trailing quads, which then compute on zeros and store nothing.
struct QuadLoop {
  u64 quad, warp_quad, stride;
  int q;
  AR_DEVICE QuadLoop() {
    q = int(thread_x() & (kQuad - 1));
    const unsigned per_cta = block_dim_x() / kQuad;  // kQuadsPerCta in the all-reduce
    quad = u64(block_x()) * per_cta + thread_x() / kQuad;
    warp_quad = quad - (thread_x() % kWarpSize) / kQuad;
    stride = u64(grid_dim_x()) * per_cta;
  }
};

template <typename T, typename C>
__device__ void quantized_twoshot(const Args& a) {
  const unsigned b = block_x();
  char* self = a.peers[a.rank];
  Header* h = header_of(self);
  if (skipped_piece(a, h, b)) return;
  const bool aborted = thread_x() == 0 && ld_relaxed_sys(&h->abort) != 0;
  const unsigned parity = h->calls[b] & 1;
  const QuadLoop L;
  const int q = L.q;
  const u64 n = a.n;
  const u64 shard = (blocks_of(n) + a.world - 1) / a.world * kBlock;
  const u64 slot_bytes = encoded_len<C>(shard);

  // ---- Phase 1: our piece of every other owner's shard, encoded, into its staging slot.
  for (unsigned j = 0; j < a.world; ++j) {
    const u64 lo = min_u64(u64(j) * shard, n), hi = min_u64(lo + shard, n);
    if (j == a.rank || lo == hi) continue;
    const Segment<C> seg(hi - lo);
    char* dst = staging_of(a.peers[j], a, parity) + u64(a.rank) * slot_bytes;
    for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      float x[kPerLane];
      load8<T>(a.input, lo + k * kBlock + q * kPerLane, hi, x);
      uint32_t u[kPerLane];
      const uint16_t field = encode_quad<C>(x, q, u);
      if (k < seg.nb) seg.store(dst, k, q, u, field);
    }
  }
  if (!barrier(a, h, b, parity, aborted)) return;
  if (!agree(a, h, b, parity)) return;

  // ---- Phase 2: our shard. Rank order from rank 0, our own piece unquantized (one
  // quantization fewer than QuickReduce, docs/codecs.md), one encode of the f32 sum, pushed
  // to every rank.
  {
    const u64 lo = min_u64(u64(a.rank) * shard, n), hi = min_u64(lo + shard, n);
    const Segment<C> seg(hi - lo);
    const char* staging = staging_of(self, a, parity);
    for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      const bool live = k < seg.nb;
      float acc[kPerLane];
      for (unsigned r = 0; r < a.world; ++r) {
        float x[kPerLane];
        if (r == a.rank) {
          load8<T>(a.input, lo + k * kBlock + q * kPerLane, hi, x);
        } else {
          uint32_t u[kPerLane] = {0, 0, 0, 0, 0, 0, 0, 0};
          uint16_t field = 0;
          if (live) field = seg.load(staging + u64(r) * slot_bytes, k, q, u);
          decode_quad<C>(u, field, q, x);
        }
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] = r == 0 ? x[i] : acc[i] + x[i];
      }
      // Past the end of the shard the sum must be the +0.0 padding the reference encodes: a
      // peer's Hadamard-coded block decodes to non-zero values there (the inverse transform
      // spreads the block's error over all 32 positions).
      const u64 e0 = lo + k * kBlock + q * kPerLane;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (e0 + i >= hi) acc[i] = 0.0f;
      uint32_t u[kPerLane];
      const uint16_t field = encode_quad<C>(acc, q, u);
      if (live)
        for (unsigned p = 0; p < a.world; ++p)
          seg.store(reduced_of(a.peers[p], a) + u64(a.rank) * slot_bytes, k, q, u, field);
    }
  }
  if (!barrier(a, h, b, parity)) return;

  // ---- Phase 3: every owner's bytes, decoded from our own `reduced`.
  for (unsigned j = 0; j < a.world; ++j) {
    const u64 lo = min_u64(u64(j) * shard, n), hi = min_u64(lo + shard, n);
    if (lo == hi) continue;
    const Segment<C> seg(hi - lo);
    const char* src = reduced_of(self, a) + u64(j) * slot_bytes;
    for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      uint32_t u[kPerLane] = {0, 0, 0, 0, 0, 0, 0, 0};
      uint16_t field = 0;
      if (k < seg.nb) field = seg.load(src, k, q, u);
      float x[kPerLane];
      decode_quad<C>(u, field, q, x);
      if (k < seg.nb) store8<T>(a.output, lo + k * kBlock + q * kPerLane, hi, x);
    }
  }

  if (thread_x() == 0) h->calls[b] += 1;
}

// ---- Segment kernels: codec::encode / codec::decode of one buffer ----------------------------

// Parameters of the segment kernels (mirrored by crates/backend-cuda/src/abi.rs).
struct CodecArgs {
  const void* src;
  void* dst;
  unsigned long long n;  // elements
};
static_assert(sizeof(CodecArgs) == 24, "CodecArgs");

// Blocks per lane per pass in the segment kernels: their loads are issued together before any
// block is coded. Measured on the H200 (docs/benchmarks.md): 4 did not speed the plain
// encoders (they are instruction-bound) and slowed the adaptive ones (87 registers: one
// block per SM), so 2 for plain codecs, 1 for adaptive.
template <typename C>
struct UnrollOf {
  static constexpr int value = C::kAdaptiveCodec ? 1 : 2;
};

// Quads of one warp: a pass of the segment kernels covers kWarpQuads consecutive blocks per
// warp and step.
constexpr int kWarpQuads = kWarpSize / kQuad;

// Loads of one 16-byte vector per step without bounds (the whole-pass fast path below).
template <typename T>
AR_DEVICE void load8_whole(const void* base, u64 e0, float (&x)[kPerLane]) {
  constexpr int E = Packed<T>::kElems;
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(base) + e0 * sizeof(T));
#pragma unroll
  for (int v = 0; v < kPerLane / E; ++v) {
    float f[E];
    Packed<T>::to_f32(p[v], f);
#pragma unroll
    for (int i = 0; i < E; ++i) x[v * E + i] = f[i];
  }
}
template <typename T>
AR_DEVICE void store8_whole(void* base, u64 e0, const float (&x)[kPerLane]) {
  constexpr int E = Packed<T>::kElems;
  uint4* p = reinterpret_cast<uint4*>(static_cast<char*>(base) + e0 * sizeof(T));
#pragma unroll
  for (int v = 0; v < kPerLane / E; ++v) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = x[v * E + i];
    p[v] = Packed<T>::from_f32(f);
  }
}

// One pass of encode_segment from block row k0 (warp-uniform). kWhole: every block the warp
// touches in this pass lies wholly inside [0, n), so no load or store needs a bounds test.
template <typename T, typename C, int kUnroll, bool kWhole>
AR_DEVICE void encode_pass(const CodecArgs& a, const QuadLoop& L, const Segment<C>& seg, u64 k0) {
  const u64 lane_k = L.quad - L.warp_quad;
  float x[kUnroll][kPerLane];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const u64 e0 = (k0 + u * L.stride + lane_k) * kBlock + L.q * kPerLane;
    if (kWhole)
      load8_whole<T>(a.src, e0, x[u]);
    else
      load8<T>(a.src, e0, a.n, x[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kWhole && k0 + u * L.stride >= seg.nb) break;  // warp-uniform
    const u64 k = k0 + u * L.stride + lane_k;
    uint32_t codes[kPerLane];
    const uint16_t field = encode_quad<C>(x[u], L.q, codes);
    if (kWhole || k < seg.nb) seg.store(static_cast<char*>(a.dst), k, L.q, codes, field);
  }
}

// T[n] -> one segment at dst (codes and scales; padding bytes are not written). Block k is
// still handled by the lane the grid-stride loop gives it; a pass covers k, k + stride, ...
// Passes whose blocks all lie inside the buffer (all but the last one or two of a warp) run
// a copy of the body without bounds tests.
template <typename T, typename C>
__device__ void encode_segment(const CodecArgs& a) {
  const QuadLoop L;
  const Segment<C> seg(a.n);
  constexpr int kUnroll = UnrollOf<C>::value;
  // Whole passes first (a warp's passes are in increasing order, so once one reaches past
  // the end, all later ones do), then the rest with bounds tests: two loops, so the fast one
  // keeps only its own values in registers.
  u64 k0 = L.warp_quad;
  for (; (k0 + (kUnroll - 1) * L.stride + kWarpQuads) * kBlock <= a.n; k0 += kUnroll * L.stride)
    encode_pass<T, C, kUnroll, true>(a, L, seg, k0);
  for (; k0 < seg.nb; k0 += kUnroll * L.stride) encode_pass<T, C, kUnroll, false>(a, L, seg, k0);
}

// One pass of decode_segment, as encode_pass.
template <typename T, typename C, int kUnroll, bool kWhole>
AR_DEVICE void decode_pass(const CodecArgs& a, const QuadLoop& L, const Segment<C>& seg, u64 k0) {
  const u64 lane_k = L.quad - L.warp_quad;
  uint32_t codes[kUnroll][kPerLane];
  uint16_t field[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const u64 k = k0 + u * L.stride + lane_k;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) codes[u][j] = 0;
    field[u] = 0;
    if (kWhole || k < seg.nb) field[u] = seg.load(static_cast<const char*>(a.src), k, L.q, codes[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kWhole && k0 + u * L.stride >= seg.nb) break;  // warp-uniform
    const u64 k = k0 + u * L.stride + lane_k;
    float x[kPerLane];
    decode_quad<C>(codes[u], field[u], L.q, x);
    if (kWhole)
      store8_whole<T>(a.dst, k * kBlock + L.q * kPerLane, x);
    else if (k < seg.nb)
      store8<T>(a.dst, k * kBlock + L.q * kPerLane, a.n, x);
  }
}

// One segment at src -> T[n], rounded to nearest even.
template <typename T, typename C>
__device__ void decode_segment(const CodecArgs& a) {
  const QuadLoop L;
  const Segment<C> seg(a.n);
  constexpr int kUnroll = 2;  // decoding is cheap: more loads in flight, no register trouble
  // Whole passes first (a warp's passes are in increasing order, so once one reaches past
  // the end, all later ones do), then the rest with bounds tests: two loops, so the fast one
  // keeps only its own values in registers.
  u64 k0 = L.warp_quad;
  for (; (k0 + (kUnroll - 1) * L.stride + kWarpQuads) * kBlock <= a.n; k0 += kUnroll * L.stride)
    decode_pass<T, C, kUnroll, true>(a, L, seg, k0);
  for (; k0 < seg.nb; k0 += kUnroll * L.stride) decode_pass<T, C, kUnroll, false>(a, L, seg, k0);
}

}  // namespace ar
