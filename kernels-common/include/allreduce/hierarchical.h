// The hierarchical quantized all-reduce (TensorRT-LLM's low-precision PCIe all-reduce at TP8):
// two NUMA groups of g = world/2 consecutive ranks. The body only; the entry points are in
// kernels-cuda/allreduce.cu and kernels-hip/allreduce.hip. The host reference is
// crates/backend-host/src/hierarchical.rs and the definition crates/core/src/hierarchical.rs;
// this kernel gives their bytes.
//
// Rank r is in group r / g with local index l = r % g; its partner r' = (r + g) % world owns
// the same in-group shard l. Shards: whole codec blocks over g owners (quantized.h's layout
// with g for world), slots of slot_bytes = encoded_len(shard).
//   1. reduce-scatter in the group: encode our piece of shard j into owner j's
//      staging[parity], slot l (j != l);                                barrier 1 (+ agreement)
//   2. partial P = our piece raw + decoded in-group pieces, local order from local 0, f32;
//      E = enc(P) goes to the partner's staging[parity] slot l and, as a stash, to our own
//      `reduced` slot l;                                                barrier 2
//   3. F = enc(decode(E_group0) + decode(E_group1)), group 0 first: the partner computes the
//      same sum from the same two byte strings, so both owners of shard l hold the same F.
//      F goes to slot l of every group member's `reduced` (ours too);   barrier 3
//   4. every rank decodes the g slots of its own `reduced`.
// All 8 ranks decode the same F bytes for every shard, so outputs are bitwise identical.
//
// Pipelining and flags: codec block k of any shard is handled by CTA (k / kQuadsPerCta) % G in
// every stage and on every rank (QuadLoop), so, as in quantized.h, each CTA meets only its
// own peers at its own per-CTA flag barrier (sync.h: device-memory epochs advanced by the
// kernel, every spin with the deadline and the abort word). CTAs do not wait for each other:
// while one CTA's chunk is in the cross-group exchange, another's is still in the in-group
// stage, so the PCIe links and the CPU interconnect carry traffic at the same time. The three
// barriers span all ranks (one flag word per peer, a few bytes; the data stay inside the group
// except stage 2's one shard): a barrier over only the group or only the partner would let a
// rank run a whole call ahead of ranks it does not wait for, which the parity argument below
// does not cover.
//
// Buffer reuse (the argument of quantized.h, with one more barrier): staging[parity] is
// written in stage 1 (before barrier 1) and stage 2 (after it); it alternates by call parity,
// so a peer's stage-1 write of call c+2 cannot meet our reads of call c. `reduced` is written
// only after barrier 1 of a call, which no rank passes before every rank finished the
// previous call. The stash in our own reduced slot l is written and read by the same CTA
// (same block k, same lanes) and only then overwritten by F: the read's values feed
// encode_quad's quad shuffles before any lane stores, so no lane overwrites the scale word
// another lane of its quad has yet to read.
#pragma once

#include "allreduce/quantized.h"

namespace ar {

// Which part of the group a rank is. world 1 is the warm-up launch (n = 0, nothing moves):
// it is its own group and partner.
struct HierGroups {
  unsigned g, base, local, partner;
  AR_DEVICE explicit HierGroups(const Args& a) {
    g = a.world >= 2 ? a.world / 2 : 1;
    base = a.rank / g * g;
    local = a.rank % g;
    partner = a.world >= 2 ? (a.rank + g) % a.world : a.rank;
  }
};

template <typename T, typename C>
__device__ void hierarchical_quantized(const Args& a) {
  CallEntry c;
  if (!enter_call(a, c)) return;
  const QuadLoop L;
  const int q = L.q;
  const u64 n = a.n;
  const HierGroups G(a);
  const u64 shard = (blocks_of(n) + G.g - 1) / G.g * kBlock;
  const u64 slot_bytes = encoded_len<C>(shard);
  const u64 lo = min_u64(u64(G.local) * shard, n), hi = min_u64(lo + shard, n);
  const Segment<C> mine(hi - lo);

  // ---- Stage 1: our piece of every other in-group owner's shard, encoded, into its staging.
  for (unsigned j = 0; j < G.g; ++j) {
    const u64 jlo = min_u64(u64(j) * shard, n), jhi = min_u64(jlo + shard, n);
    if (j == G.local || jlo == jhi) continue;
    encode_range<T, C>(L, a.input, jlo, jhi,
                       staging_of(a.peers[G.base + j], a, c.parity) + u64(G.local) * slot_bytes);
  }
  if (!barrier(a, c, c.aborted)) return;
  if (!agree(a, c)) return;

  // ---- Stage 2: the group's partial of our shard (own piece unquantized, as in quantized.h),
  // encoded once, to the partner and to our stash.
  {
    const char* staging = staging_of(c.self, a, c.parity);
    char* to_partner = staging_of(a.peers[G.partner], a, c.parity) + u64(G.local) * slot_bytes;
    char* stash = reduced_of(c.self, a) + u64(G.local) * slot_bytes;
    for (u64 k0 = L.warp_quad; k0 < mine.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      const bool live = k < mine.nb;
      const u64 e0 = lo + k * kBlock + q * kPerLane;
      float acc[kPerLane];
      for (unsigned i = 0; i < G.g; ++i) {
        float x[kPerLane];
        if (i == G.local)
          load8<T>(a.input, e0, hi, x);
        else
          decode_block_at(mine, staging + u64(i) * slot_bytes, k, q, x);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[e] = i == 0 ? x[e] : acc[e] + x[e];
      }
      zero_past(acc, e0, hi);
      Codes<C, kPerLane> u;
      const auto field = encode_quad<C>(acc, q, u);
      if (live) {
        mine.store(to_partner, k, q, u, field);
        mine.store(stash, k, q, u, field);
      }
    }
  }
  if (!barrier(a, c)) return;

  // ---- Stage 3: both groups' encoded partials, decoded and summed in group order, encoded
  // once and pushed to every rank of our group.
  {
    const char* ours = reduced_of(c.self, a) + u64(G.local) * slot_bytes;
    const char* theirs = staging_of(c.self, a, c.parity) + u64(G.local) * slot_bytes;
    const bool first_group = G.base == 0;
    for (u64 k0 = L.warp_quad; k0 < mine.nb; k0 += L.stride) {
      const u64 k = k0 + (L.quad - L.warp_quad);
      const bool live = k < mine.nb;
      const u64 e0 = lo + k * kBlock + q * kPerLane;
      float acc[kPerLane];
      for (int grp = 0; grp < 2; ++grp) {
        float x[kPerLane];
        decode_block_at(mine, (grp == 0) == first_group ? ours : theirs, k, q, x);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[e] = grp == 0 ? x[e] : acc[e] + x[e];
      }
      zero_past(acc, e0, hi);
      Codes<C, kPerLane> u;
      const auto field = encode_quad<C>(acc, q, u);
      if (live)
        for (unsigned p = 0; p < G.g; ++p)
          mine.store(reduced_of(a.peers[G.base + p], a) + u64(G.local) * slot_bytes, k, q, u,
                     field);
    }
  }
  if (!barrier(a, c)) return;

  // ---- Stage 4: every in-group owner's bytes, decoded from our own `reduced`.
  for (unsigned j = 0; j < G.g; ++j) {
    const u64 jlo = min_u64(u64(j) * shard, n), jhi = min_u64(jlo + shard, n);
    if (jlo < jhi) decode_range<T, C>(L, reduced_of(c.self, a) + u64(j) * slot_bytes, a.output, jlo, jhi);
  }

  finish_call(c);
}

}  // namespace ar
