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

#include "allreduce/segment.h"
#include "allreduce/exact.h"

namespace ar {

constexpr int kQuadsPerCta = kThreads / kQuad;  // 128 codec blocks per CTA pass

// N consecutive elements [e0, e0 + N) of T as f32, zeros at and past `end`.
template <typename T, int kN>
AR_DEVICE void load8(const void* base, u64 e0, u64 end, float (&x)[kN]) {
  constexpr int E = Packed<T>::kElems;
  const char* p = static_cast<const char*>(base);
#pragma unroll
  for (int v = 0; v < kN / E; ++v) {
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

// Rounds x into T (nearest even) and stores the elements of [e0, e0 + N) below `end`.
template <typename T, int kN>
AR_DEVICE void store8(void* base, u64 e0, u64 end, const float (&x)[kN]) {
  constexpr int E = Packed<T>::kElems;
  char* p = static_cast<char*>(base);
#pragma unroll
  for (int v = 0; v < kN / E; ++v) {
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

// Loop over codec blocks [0, nb) by lane groups of kLanes (a quad by default), grid-stride.
// The bound is tested on the warp's first group so whole warps iterate together (the codec
// functions may shuffle); `k` may be past nb for trailing groups, which then compute on zeros
// and store nothing. (`quad` names the group's block index whatever its width.)
template <int kLanes = kQuad>
struct GroupLoop {
  u64 quad, warp_quad, stride;
  int q;
  AR_DEVICE GroupLoop() {
    q = int(thread_x() & (kLanes - 1));
    const unsigned per_cta = block_dim_x() / kLanes;  // kQuadsPerCta in the all-reduce
    quad = u64(block_x()) * per_cta + thread_x() / kLanes;
    warp_quad = quad - (thread_x() % kWarpSize) / kLanes;
    stride = u64(grid_dim_x()) * per_cta;
  }
};
using QuadLoop = GroupLoop<>;

// ---- Segment loops the all-reduce kernels share (quantized_twoshot, hierarchical.h) ---------

// Elements [lo, hi) of `input`, encoded into the segment at `dst` (a peer's staging slot).
template <typename T, typename C>
AR_DEVICE void encode_range(const QuadLoop& L, const void* input, u64 lo, u64 hi, char* dst) {
  const Segment<C> seg(hi - lo);
  for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
    const u64 k = k0 + (L.quad - L.warp_quad);
    float x[kPerLane];
    load8<T>(input, lo + k * kBlock + L.q * kPerLane, hi, x);
    Codes<C, kPerLane> u;
    const auto field = encode_quad<C>(x, L.q, u);
    if (k < seg.nb) seg.store(dst, k, L.q, u, field);
  }
}

// Block k of the segment at `src`, decoded; all-zero codes past the segment's end (trailing
// quads compute on them, since decode_quad shuffles, and store nothing).
template <typename C>
AR_DEVICE void decode_block_at(const Segment<C>& seg, const char* src, u64 k, int q,
                               float (&x)[kPerLane]) {
  uint32_t u[kPerLane] = {0, 0, 0, 0, 0, 0, 0, 0};
  typename C::Side field{};
  if (k < seg.nb) field = seg.load(src, k, q, u);
  decode_quad<C>(u, field, q, x);
}

// The segment at `src` (a slot of our own `reduced`), decoded into `output`'s [lo, hi).
template <typename T, typename C>
AR_DEVICE void decode_range(const QuadLoop& L, const char* src, void* output, u64 lo, u64 hi) {
  const Segment<C> seg(hi - lo);
  for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
    const u64 k = k0 + (L.quad - L.warp_quad);
    float x[kPerLane];
    decode_block_at(seg, src, k, L.q, x);
    if (k < seg.nb) store8<T>(output, lo + k * kBlock + L.q * kPerLane, hi, x);
  }
}

// Before encoding a sum: past the shard's end it must be the +0.0 padding the reference
// encodes, while a peer's Hadamard-coded block decodes to non-zero values there (the inverse
// transform spreads the block's error over all 32 positions).
AR_DEVICE void zero_past(float (&acc)[kPerLane], u64 e0, u64 hi) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (e0 + i >= hi) acc[i] = 0.0f;
}

template <typename T, typename C>
__device__ void quantized_twoshot(const Args& a) {
  CallEntry c;
  if (!enter_call(a, c)) return;
  const QuadLoop L;
  const int q = L.q;
  const u64 n = a.n;
  const u64 shard = (blocks_of(n) + a.world - 1) / a.world * kBlock;
  const u64 slot_bytes = encoded_len<C>(shard);

  // ---- Phase 1: our piece of every other owner's shard, encoded, into its staging slot.
  for (unsigned j = 0; j < a.world; ++j) {
    const u64 lo = min_u64(u64(j) * shard, n), hi = min_u64(lo + shard, n);
    if (j == a.rank || lo == hi) continue;
    encode_range<T, C>(L, a.input, lo, hi, staging_of(a.peers[j], a, c.parity) + u64(a.rank) * slot_bytes);
  }
  if (!barrier(a, c, c.aborted)) return;
  if (!agree(a, c)) return;

  // ---- Phase 2: our shard. Rank order from rank 0, our own piece unquantized (one
  // quantization fewer than QuickReduce, docs/codecs.md), one encode of the f32 sum, pushed
  // to every rank.
  {
    const u64 lo = min_u64(u64(a.rank) * shard, n), hi = min_u64(lo + shard, n);
    const Segment<C> seg(hi - lo);
    const char* staging = staging_of(c.self, a, c.parity);
    for (u64 k0 = L.warp_quad; k0 < seg.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      const bool live = k < seg.nb;
      float acc[kPerLane];
      for (unsigned r = 0; r < a.world; ++r) {
        float x[kPerLane];
        if (r == a.rank)
          load8<T>(a.input, lo + k * kBlock + q * kPerLane, hi, x);
        else
          decode_block_at(seg, staging + u64(r) * slot_bytes, k, q, x);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] = r == 0 ? x[i] : acc[i] + x[i];
      }
      zero_past(acc, lo + k * kBlock + q * kPerLane, hi);
      Codes<C, kPerLane> u;
      const auto field = encode_quad<C>(acc, q, u);
      if (live)
        for (unsigned p = 0; p < a.world; ++p)
          seg.store(reduced_of(a.peers[p], a) + u64(a.rank) * slot_bytes, k, q, u, field);
    }
  }
  if (!barrier(a, c)) return;

  // ---- Phase 3: every owner's bytes, decoded from our own `reduced`.
  for (unsigned j = 0; j < a.world; ++j) {
    const u64 lo = min_u64(u64(j) * shard, n), hi = min_u64(lo + shard, n);
    if (lo < hi) decode_range<T, C>(L, reduced_of(c.self, a) + u64(j) * slot_bytes, a.output, lo, hi);
  }

  finish_call(c);
}

// ---- Segment kernels: codec::encode / codec::decode of one buffer ----------------------------

// Parameters of the segment kernels (mirrored by the GPU engine's `abi` module).
struct CodecArgs {
  const void* src;
  void* dst;
  unsigned long long n;  // elements
};
static_assert(sizeof(CodecArgs) == 24, "CodecArgs");

// Shape of the segment encoder per codec: kN elements per lane (codec.h: 8, a quad per block,
// or 32, a lane per block), and kUnroll blocks per lane per pass, whose loads are issued
// together before any block is coded. Quads, measured on the H200
// (docs/history/benchmarks-2026-12.md): 4 blocks per lane did not speed the plain encoders
// (instruction-bound) and slowed the adaptive ones (87 registers: one block per SM), so 2 for
// plain codecs, 1 for adaptive.
// A lane per block saves the adaptive encoder its 16 Hadamard shuffles and 6 scan and error
// shuffles per lane and block, and every encoder three quarters of its per-block scale work.
// CUDA: a lane per block, measured on the H200 (docs/history/benchmarks-2026-12.md, third
// pass: encoders 1.2-1.7x faster). HIP keeps quads: its quad shuffles are DPP moves, cheap, and 128 VGPRs would be
// the whole budget of a wave at the kernels' 4 waves per SIMD (kernels-hip). Not measured on
// AMD either way.
#ifndef AR_ENCODE_LANE_ELEMS
#if AR_HIP
#define AR_ENCODE_LANE_ELEMS 8
#else
#define AR_ENCODE_LANE_ELEMS 32
#endif
#endif
template <typename C>
struct EncodeShape {
  static constexpr int kN = AR_ENCODE_LANE_ELEMS;
  static constexpr int kUnroll = kN == 8 ? (kHadamardCodec<C> ? 1 : 2) : 1;
};

// Loads of one 16-byte vector per step without bounds (the whole-pass fast path below).
template <typename T, int kN>
AR_DEVICE void load8_whole(const void* base, u64 e0, float (&x)[kN]) {
  constexpr int E = Packed<T>::kElems;
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(base) + e0 * sizeof(T));
#pragma unroll
  for (int v = 0; v < kN / E; ++v) {
    float f[E];
    Packed<T>::to_f32(p[v], f);
#pragma unroll
    for (int i = 0; i < E; ++i) x[v * E + i] = f[i];
  }
}
template <typename T, int kN>
AR_DEVICE void store8_whole(void* base, u64 e0, const float (&x)[kN]) {
  constexpr int E = Packed<T>::kElems;
  uint4* p = reinterpret_cast<uint4*>(static_cast<char*>(base) + e0 * sizeof(T));
#pragma unroll
  for (int v = 0; v < kN / E; ++v) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = x[v * E + i];
    p[v] = Packed<T>::from_f32(f);
  }
}

// One pass of encode_segment from block row k0 (warp-uniform). kWhole: every block the warp
// touches in this pass lies wholly inside [0, n), so no load or store needs a bounds test.
template <typename T, typename C, int kN, int kUnroll, bool kWhole>
AR_DEVICE void encode_pass(const CodecArgs& a, const GroupLoop<kBlock / kN>& L,
                           const Segment<C>& seg, u64 k0) {
  const u64 lane_k = L.quad - L.warp_quad;
  float x[kUnroll][kN];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const u64 e0 = (k0 + u * L.stride + lane_k) * kBlock + L.q * kN;
    if (kWhole)
      load8_whole<T>(a.src, e0, x[u]);
    else
      load8<T>(a.src, e0, a.n, x[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kWhole && k0 + u * L.stride >= seg.nb) break;  // warp-uniform
    const u64 k = k0 + u * L.stride + lane_k;
    Codes<C, kN> codes;
    const auto field = encode_quad<C>(x[u], L.q, codes);
    if (kWhole || k < seg.nb) seg.store(static_cast<char*>(a.dst), k, L.q, codes, field);
  }
}

// T[n] -> one segment at dst (codes and scales; padding bytes are not written). Block k is
// still handled by the lane the grid-stride loop gives it; a pass covers k, k + stride, ...
// Passes whose blocks all lie inside the buffer (all but the last one or two of a warp) run
// a copy of the body without bounds tests.
template <typename T, typename C>
__device__ void encode_segment(const CodecArgs& a) {
  constexpr int kN = EncodeShape<C>::kN, kUnroll = EncodeShape<C>::kUnroll;
  constexpr int kLanes = kBlock / kN, kWarpGroups = kWarpSize / kLanes;
  const GroupLoop<kLanes> L;
  const Segment<C> seg(a.n);
  // Whole passes first (a warp's passes are in increasing order, so once one reaches past
  // the end, all later ones do), then the rest with bounds tests: two loops, so the fast one
  // keeps only its own values in registers.
  u64 k0 = L.warp_quad;
  auto whole = [&](u64 k) { return (k + (kUnroll - 1) * L.stride + kWarpGroups) * kBlock <= a.n; };
  if constexpr (kHadamardCodec<C> && kUnroll == 1) {
    // Software-pipelined: the next pass's loads go out before this pass's arithmetic. The
    // adaptive encoders run one block per SM (registers), too few warps to hide a load's
    // latency behind other warps' work.
    constexpr int kVecs = kN * int(sizeof(T)) / 16;
    const u64 lane_k = L.quad - L.warp_quad;
    auto load_raw = [&](u64 k, uint4 (&r)[kVecs]) {
      const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(a.src) +
                                                      ((k + lane_k) * kBlock + L.q * kN) * sizeof(T));
#pragma unroll
      for (int v = 0; v < kVecs; ++v) r[v] = p[v];
    };
    uint4 raw[kVecs];
    if (whole(k0)) load_raw(k0, raw);
    for (; whole(k0); k0 += L.stride) {
      constexpr int E = Packed<T>::kElems;
      float x[kN];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float f[E];
        Packed<T>::to_f32(raw[v], f);
#pragma unroll
        for (int i = 0; i < E; ++i) x[v * E + i] = f[i];
      }
      if (whole(k0 + L.stride)) load_raw(k0 + L.stride, raw);
      Codes<C, kN> codes;
      const auto field = encode_quad<C>(x, L.q, codes);
      seg.store(static_cast<char*>(a.dst), k0 + lane_k, L.q, codes, field);
    }
  } else {
    for (; whole(k0); k0 += kUnroll * L.stride) encode_pass<T, C, kN, kUnroll, true>(a, L, seg, k0);
  }
  for (; k0 < seg.nb; k0 += kUnroll * L.stride) encode_pass<T, C, kN, kUnroll, false>(a, L, seg, k0);
}

// Shape of the segment decoder, as EncodeShape: quads, 2 blocks per lane in flight; on CUDA the
// adaptive decoders take pairs instead (16 elements a lane, 1 block in flight), which halves the
// inverse transform's shuffles (one cross-lane stage, not two): H200, 256 MiB of bf16, q6a
// 118.9 -> 112.8 us, q4a 103.0 -> 98.2, q8a unchanged. A lane per block (no shuffles) was
// slower: q8a 192 us against 141 (64-byte stores per lane, fewer blocks in flight). HIP keeps
// quads (not measured there).
#ifndef AR_DECODE_PAIRS
#define AR_DECODE_PAIRS !AR_HIP
#endif
template <typename C>
struct DecodeShape {
  static constexpr int kN = AR_DECODE_PAIRS && kHadamardCodec<C> ? 2 * kPerLane : kPerLane;
  static constexpr int kUnroll = kN == kPerLane ? 2 : 1;
};

// One pass of decode_segment, as encode_pass.
template <typename T, typename C, int kN, int kUnroll, bool kWhole>
AR_DEVICE void decode_pass(const CodecArgs& a, const GroupLoop<kBlock / kN>& L,
                           const Segment<C>& seg, u64 k0) {
  const u64 lane_k = L.quad - L.warp_quad;
  uint32_t codes[kUnroll][kN];
  typename C::Side field[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const u64 k = k0 + u * L.stride + lane_k;
#pragma unroll
    for (int j = 0; j < kN; ++j) codes[u][j] = 0;
    field[u] = typename C::Side{};
    if (kWhole || k < seg.nb) field[u] = seg.load(static_cast<const char*>(a.src), k, L.q, codes[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!kWhole && k0 + u * L.stride >= seg.nb) break;  // warp-uniform
    const u64 k = k0 + u * L.stride + lane_k;
    float x[kN];
    decode_quad<C>(codes[u], field[u], L.q, x);
    if (kWhole)
      store8_whole<T>(a.dst, k * kBlock + L.q * kN, x);
    else if (k < seg.nb)
      store8<T>(a.dst, k * kBlock + L.q * kN, a.n, x);
  }
}

// One segment at src -> T[n], rounded to nearest even.
template <typename T, typename C>
__device__ void decode_segment(const CodecArgs& a) {
  constexpr int kN = DecodeShape<C>::kN, kUnroll = DecodeShape<C>::kUnroll;
  constexpr int kLanes = kBlock / kN, kWarpGroups = kWarpSize / kLanes;
  const GroupLoop<kLanes> L;
  const Segment<C> seg(a.n);
  // Whole passes first (a warp's passes are in increasing order, so once one reaches past
  // the end, all later ones do), then the rest with bounds tests: two loops, so the fast one
  // keeps only its own values in registers.
  u64 k0 = L.warp_quad;
  auto whole = [&](u64 k) { return (k + (kUnroll - 1) * L.stride + kWarpGroups) * kBlock <= a.n; };
  if constexpr (kHadamardCodec<C>) {
    // Software-pipelined like the adaptive encoders: the next pass's codes and scales are
    // loaded before this pass's inverse transforms (the adaptive decoders run at 2 blocks
    // per SM, where the plain ones run at 4).
    const u64 lane_k = L.quad - L.warp_quad;
    const char* src = static_cast<const char*>(a.src);
    Codes<C, kN> raw[kUnroll];
    typename C::Side raw_field[kUnroll];
    auto load_raw = [&](u64 kk) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const u64 k = kk + u * L.stride + lane_k;
        load_codes<C>(src + k * C::kCodeBytes, L.q, raw[u]);
        raw_field[u] = seg.load_side_of(src, k);
      }
    };
    if (whole(k0)) load_raw(k0);
    for (; whole(k0); k0 += kUnroll * L.stride) {
      uint32_t codes[kUnroll][kN];
      typename C::Side field[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        unpack_codes(raw[u], codes[u]);
        field[u] = raw_field[u];
      }
      if (whole(k0 + kUnroll * L.stride)) load_raw(k0 + kUnroll * L.stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const u64 k = k0 + u * L.stride + lane_k;
        float x[kN];
        decode_quad<C>(codes[u], field[u], L.q, x);
        store8_whole<T>(a.dst, k * kBlock + L.q * kN, x);
      }
    }
  } else {
    for (; whole(k0); k0 += kUnroll * L.stride) decode_pass<T, C, kN, kUnroll, true>(a, L, seg, k0);
  }
  for (; k0 < seg.nb; k0 += kUnroll * L.stride) decode_pass<T, C, kN, kUnroll, false>(a, L, seg, k0);
}

}  // namespace ar
