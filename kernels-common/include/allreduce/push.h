// The plain exact all-reduce by push (Strategy::PushOneShot): the fused one-shot's Lamport
// protocol (fused.h: -0.0 sentinel, three rotating buffers, per-block call state in device
// memory, the call tag that carries the descriptor) with no epilogue, over a flat buffer of
// any length instead of rows. Every rank pushes its input into slot `rank` of every rank's
// current buffer (its own included), refills its stale buffer, checks the peers' tags, then
// polls, sums in rank order and writes its output. No barrier, no flag word: one hop.
//
// What differs from the fused one-shot, and why:
// - The buffers are dtype-agnostic, because one communicator's calls change dtype from call to
//   call: a buffer is refilled by the call two calls before the one that reads it. So the
//   protocol's bookkeeping (refills, slots, the skipped-call refill) runs in f32 units: the
//   host passes hidden = 4 (a "row" is one 16-byte vector, so tokens = vectors) and max_elems
//   = slot bytes / 4, and every fill writes the f32 sentinel 0x80000000. That word is -0.0 to
//   an f32 check and holds a 16-bit -0.0 (its high half) to an f16/bf16 check, so a vector
//   filled by any call reads "not written" to a call of any dtype. Pushed data never holds
//   the sentinel of its own T (plus_zero), and a reader polls only data of its own call's T
//   (the tags are compared before any data is read).
// - Any length: the last vector holds `tail` elements (0: whole), loaded zero-padded
//   (+0.0, never a sentinel) and stored partially, as the exact kernels do.
// - The sum keeps -0.0 results that the rounding to T gives (an f32 sum that is a tiny
//   negative number): only the inputs are canonicalised, not the output, so the result is
//   the exact one-shot's on inputs with -0.0 as +0.0 (allreduce_core::Strategy::PushOneShot).
// - Our own input is pushed to ourselves too (no own-input shortcut): the calls are latency
//   bound (the shortcut cost the fused cluster kernel 0.3-0.7 us), and in place (output ==
//   input) the push to ourselves, which the reducer waits for, orders our read of an input
//   vector before any write of the output vector that replaces it.
// - A rank whose call the host refused launches with pattern kPatternPushRejected and no data:
//   its tag differs from every peer's, so all ranks skip the call together (kErrorFusedMismatch,
//   reported as PeerRejected) instead of waiting out the deadline.
//
// Launch contract: fused.h's, with the exact kernels' grid (the communicator's G).
#pragma once

#include "allreduce/fused.h"

namespace ar {
namespace fused {

constexpr uint32_t kPatternPush = 4, kPatternPushRejected = 5;

// What this rank says the call is: vectors, elements in the last one, dtype. Decoded on the
// host by allreduce_gpu::push::describe.
template <typename T>
AR_DEVICE u64 push_desc(const FusedKernelArgs& a) {
  return (u64)a.tokens << 32 | (u64)(a.tail & 0xffffffu) << 8 | (u64)(a.pattern & 0xfu) << 4 |
         DTypeCode<T>::kCode << 1 | 1u;
}

// Input vector v, -0.0 as +0.0; the last one zero-padded when it is partial.
template <typename T>
AR_DEVICE uint4 push_load(const FusedKernelArgs& a, u64 v, u64 full) {
  const uint4* in = static_cast<const uint4*>(a.input) + v;
  return plus_zero<T>(v < full ? *in : load_partial<T>(in, int(a.tail)));
}

template <typename T, int W>
__device__ void push_oneshot(const FusedKernelArgs& a) {
  const uint32_t world = world_of<W>(a);
  const u64 nvec = a.tokens;
  const u64 full = a.tail != 0 ? nvec - 1 : nvec;
  const Spread sp = spread_from_last();
  // As oneshot_exchange: the first round of input loads before the call state, so the first
  // push waits for one memory latency, not two.
  uint4 x[kPushUnroll];
  pdl_wait();
#pragma unroll
  for (int u = 0; u < kPushUnroll; ++u)
    if (sp.first + u * sp.stride < nvec) x[u] = push_load<T>(a, sp.first + u * sp.stride, full);
  Call c;
  begin(a, c);
  const u64 desc = push_desc<T>(a);
  send_tag(a, c.calls, c.buffer, desc);

  // ---- Phase 1: our input into slot `rank` of every rank's current buffer.
  for (u64 v0 = sp.first; v0 < nvec; v0 += kPushUnroll * sp.stride) {
    if (v0 != sp.first) {
#pragma unroll
      for (int u = 0; u < kPushUnroll; ++u)
        if (v0 + u * sp.stride < nvec) x[u] = push_load<T>(a, v0 + u * sp.stride, full);
    }
#pragma unroll
    for (int u = 0; u < kPushUnroll; ++u) {
      if (v0 + u * sp.stride >= nvec) continue;
      for (uint32_t p = 0; p < world; ++p)
        st_volatile(slot<float>(a, a.lamport[p], c.buffer, a.rank) + v0 + u * sp.stride, x[u]);
    }
  }

  // ---- Phase 2: refill the stale buffer (in f32 units, see the header), then agree.
  refill<float, W, true>(a, c);
  const bool refused = a.pattern == kPatternPushRejected;  // its caller has the error already
  if (!after_tags<float, W, true>(a, c, tags_agree(a, c.calls, c.buffer, desc, !refused))) return;

  // ---- Phase 3: every rank's vector v, summed in rank order from rank 0's value (every rank
  // computes the same bits), rounded once. All world loads in flight, then polls for the
  // ones not there yet. Blocks from the first, so the SMs that wait are not the ones that
  // issued the pushes (spread_from_last).
  char* self = a.lamport[a.rank];
  uint4* out = static_cast<uint4*>(a.allreduce_out);
  bool ok = true;
  for (u64 v = (u64)block_x() * kThreads + thread_x(); v < nvec && ok; v += sp.stride) {
    uint4 raw[Ranks<W>::kN];
#pragma unroll
    for (int r = 0; r < Ranks<W>::kN; ++r)
      if (r < int(world)) raw[r] = ld_volatile(slot<float>(a, self, c.buffer, r) + v);
#pragma unroll
    for (int r = 0; r < Ranks<W>::kN; ++r)
      if (ok && r < int(world) && has_sentinel<T>(raw[r]))
        ok = poll<T>(slot<float>(a, self, c.buffer, r) + v, raw[r], a, c.calls);
    if (!ok) break;
    constexpr int E = Packed<T>::kElems;
    float acc[E], y[E];
    Packed<T>::to_f32(raw[0], acc);
#pragma unroll
    for (int r = 1; r < Ranks<W>::kN; ++r) {
      if (r < int(world)) {
        Packed<T>::to_f32(raw[r], y);
#pragma unroll
        for (int k = 0; k < E; ++k) acc[k] += y[k];
      }
    }
    const uint4 sum = Packed<T>::from_f32(acc);
    if (v < full)
      out[v] = sum;
    else
      store_partial<T>(out + v, sum, int(a.tail));
  }
  if (sync_block_or(!ok)) return;
  // Every vector of our own slot was written (we pushed to ourselves): the next call refills
  // all `world` slots.
  finish(a, c, false, true);
}

}  // namespace fused
}  // namespace ar
