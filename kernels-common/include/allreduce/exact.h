// Exact one-shot and two-shot all-reduce (f32, f16, bf16) and the roofline copy: the kernel
// bodies, written once for every vendor. kernels-cuda/allreduce.cu and
// kernels-hip/allreduce.hip only wrap them in extern "C" kernels with their launch bounds.
//
// ABI, launch contract and workspace layout: abi.h.
//
// Arithmetic (shared with the host reference, docs/architecture.md): f32 accumulation in rank
// order 0..world-1 starting from rank 0's value, one round-to-nearest-even into T. Every rank
// therefore produces the same bits, and one-shot and two-shot produce the same bits.
#pragma once

#include "allreduce/abi.h"
#include "allreduce/shim.h"
#include "allreduce/sync.h"
#include "allreduce/vec.h"

namespace ar {

// ---- Workspace addressing and the barrier ----------------------------------------------------

AR_DEVICE Header* header_of(char* ws) { return reinterpret_cast<Header*>(ws); }
AR_DEVICE uint32_t* flags_of(char* ws, unsigned b) {
  return reinterpret_cast<uint32_t*>(ws + kFlagsOffset) + b * kMaxWorld;
}
AR_DEVICE unsigned long long* desc_of(char* ws, unsigned parity, unsigned b) {
  return reinterpret_cast<unsigned long long*>(ws + kDescOffset) + (parity * kMaxBlocks + b) * kMaxWorld;
}
AR_DEVICE char* staging_of(char* ws, const Args& a, unsigned parity) {
  return ws + kStagingOffset + parity * a.max_bytes;
}
AR_DEVICE char* reduced_of(char* ws, const Args& a) {
  return ws + kStagingOffset + 2 * a.max_bytes;
}

AR_DEVICE void record_timeout(Control* c, const Args& a, unsigned b, uint32_t epoch, u64 waited) {
  if (cas_sys(&c->error, 0u, kErrorTimeout) != 0u) return;  // keep the first report
  c->rank = a.rank;
  c->theirs = 0;  // a barrier's flags (not kTimeoutInFused)
  c->block = b;
  c->epoch = epoch;
  c->waited_ns = waited;
}

// Where a kernel on the exact workspace stands in a call once it has entered it.
struct CallEntry {
  unsigned b;                // this block
  char* self;                // our own workspace
  Header* h;                 // its header
  unsigned parity;           // the call's parity: picks the staging and descriptor slots
  unsigned long long tag;    // the call's descriptor tag: kDescTag or 0 (call_tag)
  uint32_t calls;            // calls[b] at entry
  uint32_t epoch;            // the block's last barrier epoch, kept in step by barrier()
  bool aborted;              // the abort word at entry, in thread 0 (false elsewhere)
};

// The tag or-ed into every descriptor word this call writes. A descriptor slot is rewritten
// every second call (its parity), so the word it holds is this call's or the one two calls
// back, and bit 1 of calls[b] tells those apart; inverted, so that the zeroed slots of a new
// workspace read as stale for calls 0 and 1. calls[b] is the same on every rank for the same
// call (each block's counter advances once per call on every path), so equal calls carry equal
// tags and words compare whole. What the tag buys: a reader can tell a word of this call from
// a stale one without the writer ordering it before a released flag (registered_entry).
AR_DEVICE unsigned long long call_tag(uint32_t calls) { return (calls & 2u) ? 0ull : kDescTag; }
AR_DEVICE unsigned long long untagged(unsigned long long word) { return word & ~kDescTag; }

AR_DEVICE unsigned long long* desc2_of(char* ws, unsigned parity, unsigned b) {
  return reinterpret_cast<unsigned long long*>(ws + kDesc2Offset) + (parity * kMaxBlocks + b) * kMaxWorld;
}

struct RankFlags {
  const Args& a;
  const CallEntry& c;
  // Whether the barrier also publishes our descriptor words. The staged paths do at every
  // barrier (the same words each time); the registered kernels publish theirs once, at entry,
  // and their later barriers must not rewrite them while a peer may still be reading them.
  bool describe;
  // Our descriptor travels with the flag: these plain stores are ordered before the release.
  // The second word carries no registration on the staged paths, only the tag: a registered
  // peer reads ours only if our first word says registered, but rewriting it every call keeps
  // a stale word from two calls back from ever carrying this call's tag.
  AR_DEVICE uint32_t* to_peer(int peer) const {
    if (describe) {
      desc_of(a.peers[peer], c.parity, c.b)[a.rank] = a.desc | c.tag;
      desc2_of(a.peers[peer], c.parity, c.b)[a.rank] = c.tag;
    }
    return flags_of(a.peers[peer], c.b) + a.rank;
  }
  AR_DEVICE const uint32_t* from_peer(int peer) const {
    return flags_of(a.peers[a.rank], c.b) + peer;
  }
  AR_DEVICE void on_timeout(int, uint32_t epoch, u64 waited) const {
    record_timeout(a.control, a, c.b, epoch, waited);
    // Every rank's kernels leave at their next check; the host learns it from our Control.
    for (int r = 0; r < int(a.world); ++r) st_release_sys(&header_of(a.peers[r])->abort, 1u);
    fence_system();
  }
  AR_DEVICE void on_abort() const { record_aborted(a.control, a.rank, c.b); }
};

// Why a per-block barrier is enough even when n changes between calls: vector v is always
// handled by block (v / kThreads) % G, a function of v and the fixed G only, so block b of
// every rank reads and writes the same addresses ("class b") of every buffer in every call.
// Whatever block b of a peer touches of ours, only our block b also touches.
//
// The epoch lives in a register for the call (read once at entry, with calls[b]) and is
// written back for the next call without being read again: each dependent load of the header
// is a round trip in the fixed cost of a small call.
template <bool Release = true>
AR_DEVICE bool barrier(const Args& a, CallEntry& c, bool aborted_at_entry = false, bool describe = true) {
  const uint32_t e = c.epoch + 1;
  if (!flag_barrier<Release>(RankFlags{a, c, describe}, e, a.world, &c.h->abort, a.timeout_ns,
                             aborted_at_entry))
    return false;
  c.epoch = e;
  if (thread_x() == 0) c.h->epoch[c.b] = e;
  return true;
}

// The call is over on this block: the next one takes the other parity.
AR_DEVICE void finish_call(const CallEntry& c) {
  if (thread_x() == 0) c.h->calls[c.b] = c.calls + 1;
}

// Record a disagreement (the first report wins) and skip the call with every rank. `mine` and
// `theirs` are the first pair of words that differ, untagged.
AR_DEVICE void report_mismatch(const Args& a, const CallEntry& c, int peer, unsigned long long mine,
                               unsigned long long theirs) {
  // A rank that was itself refused has already told its caller; it reports nothing more.
  if (a.desc != kDescRejected && cas_sys(&a.control->error, 0u, kErrorMismatch) == 0u) {
    a.control->rank = peer;
    a.control->block = c.b;
    a.control->epoch = c.epoch;
    a.control->mine = untagged(mine);
    a.control->theirs = untagged(theirs);
    fence_system();
  }
}

AR_DEVICE void skip_call(const CallEntry& c) {
  finish_call(c);
  if (thread_x() == 0) c.h->skip[c.b] = 1;  // this call's later pieces, if any, are skipped too (abi.h)
}

// After the first barrier: do all ranks describe the same call? Every rank sees the same
// descriptors, so either all go on or all skip the call, and skipping together keeps their
// barriers and parities in step; the group stays usable. The descriptors were written before
// the flags we acquired, except a registered peer's (registered_entry), which may still read
// stale here: its tag then differs, and a registered peer differs from us anyway. Desc slots
// alternate by parity for the same reason staging does.
AR_DEVICE bool agree(const Args& a, const CallEntry& c) {
  const unsigned long long* slots = desc_of(c.self, c.parity, c.b);
  const unsigned long long mine = a.desc | c.tag;
  const int peer = thread_x();
  unsigned long long theirs = mine;
  if (peer < int(a.world)) theirs = *reinterpret_cast<const volatile unsigned long long*>(&slots[peer]);
  const bool differs = theirs != mine;
  if (!sync_block_or(differs)) return true;
  if (differs) report_mismatch(a, c, peer, mine, theirs);
  skip_call(c);
  return false;
}

// At kernel entry: whether this is a later piece of a call whose first piece the ranks skipped
// (then the block returns at once, touching nothing, as every rank's block does). A first piece
// clears the mark. Block-local, like everything in the header.
AR_DEVICE bool skipped_piece(const Args& a, Header* h, unsigned b) {
  if ((a.desc & kDescContinued) == 0) {
    if (thread_x() == 0) h->skip[b] = 0;
    return false;
  }
  return sync_block_or(thread_x() == 0 && h->skip[b] != 0);
}

// The prologue of every kernel on the exact workspace (one-shot, two-shot, quantized,
// hierarchical). False: the block returns at once. The order is the contract:
// - The skip check comes first, so a skipped piece reads nothing more of the header (every
//   rank's block leaves having touched the same nothing), and a first piece clears its mark
//   before anything else of the call runs.
// - The abort word is read now but acted on only at the first barrier (flag_barrier's
//   leave_now), so the load's latency overlaps phase 1; running phase 1 after an abort is
//   harmless, as it touches only our own workspace.
// - The parity and tag are read before phase 1 by every thread: calls[b] changes only after
//   the call's last barrier (or when the call is skipped), so all threads of the block agree.
AR_DEVICE bool enter_call(const Args& a, CallEntry& c) {
  c.b = block_x();
  c.self = a.peers[a.rank];
  c.h = header_of(c.self);
  if (skipped_piece(a, c.h, c.b)) return false;
  c.aborted = thread_x() == 0 && ld_relaxed_sys(&c.h->abort) != 0;
  c.calls = c.h->calls[c.b];
  c.epoch = c.h->epoch[c.b];
  c.parity = c.calls & 1;
  c.tag = call_tag(c.calls);
  return true;
}

// ---- Kernel bodies ---------------------------------------------------------------------------

// Vector geometry of one call: nvec 16-byte vectors, the last one holding `tail` elements
// when n * sizeof(T) is not a multiple of 16 (tail == 0: all full).
template <typename T>
struct Geometry {
  static constexpr int kElems = Packed<T>::kElems;
  u64 nvec, full;
  int tail;
  AR_DEVICE explicit Geometry(u64 n)
      : nvec((n + kElems - 1) / kElems), full(n / kElems), tail(int(n % kElems)) {}
};

// Phase 1 of both kernels: our input vectors of class b into our staging. The workspace side
// always gets whole vectors (a partial one is zero-padded), so later phases read whole vectors.
//
// Copies (this one and the two-shot's gather) move kCopyUnroll vectors per thread per step, all
// loads before any store: with one load in flight per thread a copy is latency-bound (the
// compiler cannot hoist the next load above a store that may alias it), and on virtual ranks
// the grid is as small as 16 blocks.
constexpr int kCopyUnroll = 4;

template <typename T>
AR_DEVICE void stage_input(const Args& a, const Geometry<T>& g, char* staging) {
  const uint4* in = static_cast<const uint4*>(a.input);
  uint4* st = reinterpret_cast<uint4*>(staging);
  const u64 stride = (u64)grid_dim_x() * kThreads;
  u64 v = (u64)block_x() * kThreads + thread_x();
  for (; v + (kCopyUnroll - 1) * stride < g.full; v += kCopyUnroll * stride) {
    uint4 x[kCopyUnroll];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) x[k] = in[v + k * stride];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) st[v + k * stride] = x[k];
  }
  for (; v < g.nvec; v += stride) st[v] = v < g.full ? in[v] : load_partial<T>(in + v, g.tail);
}

// The world's loaded vectors summed in rank order, rounded once to T. Rank order from rank 0's
// value, not reordered by our own rank, so every rank computes the same bits (and -0.0 + -0.0
// stays -0.0, which starting from 0.0 would not).
// `W` bounds the world (the array's size).
template <typename T, int W>
AR_DEVICE uint4 sum_in_rank_order(const Args& a, const uint4 (&raw)[W]) {
  constexpr int E = Packed<T>::kElems;
  float acc[E], x[E];
  Packed<T>::to_f32(raw[0], acc);
#pragma unroll
  for (int r = 1; r < W; ++r) {
    if (r < int(a.world)) {
      Packed<T>::to_f32(raw[r], x);
#pragma unroll
      for (int k = 0; k < E; ++k) acc[k] += x[k];
    }
  }
  return Packed<T>::from_f32(acc);
}

// sum over ranks of vector v of each rank's `region(ws)`, rounded once to T.
template <typename T, typename Region>
AR_DEVICE uint4 reduce_vector(const Args& a, Region region, u64 v) {
  // All loads first, so the world's worth of remote reads are in flight together.
  uint4 raw[kMaxWorld];
#pragma unroll
  for (int r = 0; r < kMaxWorld; ++r)
    if (r < int(a.world))
      raw[r] = load_peer(reinterpret_cast<const uint4*>(region(a.peers[r])) + v);
  return sum_in_rank_order<T>(a, raw);
}

// Up to four ranks, the reduce loops take two vectors per thread per step (v and v + stride,
// both of class b), all 2 x world loads before the sums: like the copies, a reduce with one
// vector per rank in flight per thread is latency-bound at two ranks. (Eight ranks already
// have eight in flight, and two vectors of eight would not fit two blocks per SM.) `load(r, v)`
// reads rank r's whole vector v. Returns where the caller's one-vector loop goes on.
template <typename T, typename Load>
AR_DEVICE u64 reduce_pairs(const Args& a, const Geometry<T>& g, u64 v, u64 stride, Load load) {
  constexpr int W = 4;
  if (int(a.world) > W) return v;
  uint4* out = static_cast<uint4*>(a.output);
  for (; v + stride < g.full; v += 2 * stride) {
    uint4 x0[W], x1[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r < int(a.world)) {
        x0[r] = load(r, v);
        x1[r] = load(r, v + stride);
      }
    }
    out[v] = sum_in_rank_order<T>(a, x0);
    out[v + stride] = sum_in_rank_order<T>(a, x1);
  }
  return v;
}

template <typename T>
AR_DEVICE void store_output(const Args& a, const Geometry<T>& g, u64 v, const uint4& val) {
  uint4* out = static_cast<uint4*>(a.output);
  if (v < g.full)
    out[v] = val;
  else
    store_partial<T>(out + v, val, g.tail);
}

// One barrier: everyone stages, then everyone reduces everything. No closing barrier: the
// staging buffer alternates by call parity, so a rank may start call k+1 while a peer still
// reads its call-k staging, and it cannot reach call k+2 (same buffer again) before passing
// call k+1's barrier, which the peer only enters once done reading call k.
template <typename T>
__device__ void oneshot(const Args& a) {
  CallEntry c;
  if (!enter_call(a, c)) return;
  const Geometry<T> g(a.n);

  // ---- Phase 1: stage our input.
  stage_input<T>(a, g, staging_of(c.self, a, c.parity));
  if (!barrier(a, c, c.aborted)) return;
  if (!agree(a, c)) return;

  // ---- Phase 2: reduce every rank's staged input into our output.
  auto staging = [&](char* ws) { return staging_of(ws, a, c.parity); };
  const u64 stride = (u64)grid_dim_x() * kThreads;
  auto staged = [&](int r, u64 v) { return load_peer(reinterpret_cast<const uint4*>(staging(a.peers[r])) + v); };
  for (u64 v = reduce_pairs<T>(a, g, (u64)c.b * kThreads + thread_x(), stride, staged); v < g.nvec; v += stride)
    store_output<T>(a, g, v, reduce_vector<T>(a, staging, v));

  // Every thread read calls[b] before the barrier; only this write follows it.
  finish_call(c);
}

// The two-shot's all-gather: every vector from its owner's `reduced` (owner r holds vectors
// [r * sv, (r + 1) * sv)), bit for bit, kCopyUnroll loads in flight per thread. The owner is
// tracked incrementally: a 64-bit division per vector costs registers we do not have to spare
// at two blocks per SM.
template <typename T>
AR_DEVICE void gather_reduced(const Args& a, const Geometry<T>& g, u64 first, u64 stride, u64 sv) {
  unsigned owner = 0;
  auto src = [&](u64 v) {
    while (v >= (owner + 1ull) * sv) ++owner;
    return reinterpret_cast<const uint4*>(reduced_of(a.peers[owner], a)) + v;
  };
  uint4* out = static_cast<uint4*>(a.output);
  u64 v = first;
  for (; v + (kCopyUnroll - 1) * stride < g.full; v += kCopyUnroll * stride) {
    uint4 x[kCopyUnroll];
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) x[k] = load_peer(src(v + k * stride));
#pragma unroll
    for (int k = 0; k < kCopyUnroll; ++k) out[v + k * stride] = x[k];
  }
  for (; v < g.nvec; v += stride) store_output<T>(a, g, v, load_peer(src(v)));
}

// Two barriers: stage; each rank reduces its shard and rounds it once; everyone gathers the
// rounded shards. Shards are whole 16-byte granules (allreduce_core::layout with granule
// 16 / sizeof(T)): rank r owns vectors [r * sv, (r + 1) * sv), sv = ceil(nvec / world).
template <typename T>
__device__ void twoshot(const Args& a) {
  // Parity-indexed staging like one-shot, though two-shot alone could use one buffer: a
  // one-shot call has no closing barrier, so right after one a peer may still be reading the
  // staging of that call's parity.
  CallEntry c;
  if (!enter_call(a, c)) return;
  const Geometry<T> g(a.n);
  const u64 stride = (u64)grid_dim_x() * kThreads;
  const u64 first = (u64)c.b * kThreads + thread_x();  // this thread's first vector
  const u64 sv = (g.nvec + a.world - 1) / a.world;

  // ---- Phase 1: stage our input.
  stage_input<T>(a, g, staging_of(c.self, a, c.parity));
  if (!barrier(a, c, c.aborted)) return;
  if (!agree(a, c)) return;

  // ---- Phase 2: reduce-scatter. Our shard, rounded once, into our `reduced` at the same
  // offsets. Start at the grid-stride step that reaches our shard instead of scanning from 0.
  auto staging = [&](char* ws) { return staging_of(ws, a, c.parity); };
  const u64 lo = (u64)a.rank * sv, hi = min_u64(lo + sv, g.nvec);
  uint4* reduced = reinterpret_cast<uint4*>(reduced_of(c.self, a));
  for (u64 v = lo / stride * stride + first; v < hi; v += stride)
    if (v >= lo) reduced[v] = reduce_vector<T>(a, staging, v);
  // Every owner's shard is complete past this point. (`reduced` needs no parity: a peer reads
  // ours in phase 3 and only then enters the next call's first barrier, which we must pass
  // before our next phase 2 writes it.)
  if (!barrier(a, c)) return;

  // ---- Phase 3: all-gather. Every vector from its owner's `reduced`, bit for bit.
  gather_reduced<T>(a, g, first, stride, sv);

  finish_call(c);
}

// ---- Registered inputs: read in place from every rank's registered memory ------------------
//
// The staged kernels copy our input into our workspace before the first barrier so that peers
// read it there; the registered ones let peers read it where it is (RegisteredArgs::inputs),
// one read and one write of the message fewer per rank. What that changes in the protocol:
// - The entry publishes nothing but the descriptor words, so it needs no release: a rank's
//   input is complete once its kernel runs (stream order; the kernel boundary makes earlier
//   work's writes visible to peers, as vLLM's start barrier also relies on), and its block b
//   reaches the entry only then. The entry is therefore relaxed stores of tagged descriptor
//   words (call_tag), and the waits are for words carrying this call's tag (registered_entry).
//   That is most of the fixed cost of a small call: a system-scope release waits for the
//   block's stores to reach every peer.
// - A rank's input is not ours to reuse: its next stream operation may overwrite it as soon as
//   its kernel ends, so no rank may still be reading it then. One-shot therefore closes with a
//   barrier (block b of a rank leaves only after block b of every rank is done reading class
//   b, and the rank's kernel ends only after all its blocks did), relaxed too (flag_barrier);
//   two-shot's second barrier already is one, as nobody reads inputs after it, and stays a
//   release because it publishes the reduced shards.
// - Epochs, parities, the skip mark and the abort word are the staged kernels', untouched:
//   calls[b] advances once per call either way, so staged and registered calls mix in any
//   order. The entry still stores the flag (relaxed), so a staged peer's barrier is met and
//   every rank's epoch advances alike. A registered call writes no staging; a staged call
//   after it reuses the staging of the call before, which every peer finished reading before
//   its kernel of the registered call began. `reduced` is written and read as two-shot always
//   has.
// - The ranks compare a second word (the registration and offset) besides the descriptor,
//   whose kDescRegistered bit already separates the two paths; the word has parity slots of
//   its own for the reason desc does.

// Publish our two words and the flag to every peer, wait for every peer's words of this call,
// compare. The same all-or-none argument as agree(): every rank compares the same pairs once
// it has them. A staged peer's first word (released before its flag) lacks kDescRegistered,
// so its second word is never waited for; a registered peer's second word is, as the two
// words are not ordered. The report names the first word that differs: desc, or else desc2
// (told apart by the host by desc2's clear low bits). A rank whose graph slot is not `ready`
// publishes kDesc2Unregistered, which no peer's word equals, and skips whatever it reads, so
// the ranks skip together however many of them are unready; it reports its own word.
AR_DEVICE bool registered_entry(const RegisteredArgs& r, CallEntry& c, bool ready) {
  const Args& a = r.a;
  const RankFlags f{a, c, false};
  const uint32_t e = c.epoch + 1;
  const unsigned long long mine = a.desc | c.tag, mine2 = (ready ? r.desc2 : kDesc2Unregistered) | c.tag;
  unsigned long long theirs = mine, theirs2 = mine2;
  // An abort seen at entry is acted on with any failure of the wait, at the one block barrier
  // below: publishing our words first is harmless, as the group is being torn down anyway.
  bool leave = c.aborted;
  const int peer = thread_x();
  if (peer < int(a.world) && !leave) {
    char* ws = a.peers[peer];
    st_relaxed_sys(&desc2_of(ws, c.parity, c.b)[a.rank], mine2);
    st_relaxed_sys(&desc_of(ws, c.parity, c.b)[a.rank], mine);
    st_relaxed_sys(f.to_peer(peer), e);
    const unsigned long long* slot = &desc_of(c.self, c.parity, c.b)[peer];
    const unsigned long long* slot2 = &desc2_of(c.self, c.parity, c.b)[peer];
    // Both words are loaded together (one round trip per spin, not two in a row); the second
    // counts only once the first says the peer is on the registered path.
    auto fresh = [&] {
      theirs = ld_relaxed_sys(slot);
      theirs2 = ld_relaxed_sys(slot2);
      return (theirs & kDescTag) == c.tag &&
             ((theirs & kDescRegistered) == 0 || (theirs2 & kDescTag) == c.tag);
    };
    leave = !spin_until(fresh, &c.h->abort, a.timeout_ns, [&](u64 waited) { f.on_timeout(peer, e, waited); });
    if ((theirs & kDescRegistered) == 0) theirs2 = mine2;  // a staged peer's second word says nothing
  }
  const bool differs = theirs != mine || theirs2 != mine2;
  const bool unready = !ready && thread_x() == 0;
  // One block barrier on the fast path; the slow ones tell leaving from disagreeing.
  const bool fine = !sync_block_or(leave || differs || unready);
  if (!fine && sync_block_or(leave)) {
    if (thread_x() == 0) f.on_abort();
    return false;
  }
  c.epoch = e;
  if (thread_x() == 0) c.h->epoch[c.b] = e;
  if (fine) return true;
  if (differs) {
    const bool first = theirs != mine;
    report_mismatch(a, c, peer, first ? mine : mine2, first ? theirs : theirs2);
  } else if (unready) {
    report_mismatch(a, c, a.rank, mine2, r.desc2);
  }
  skip_call(c);
  return false;
}

// Every rank's input of a call captured on a graph slot, from the slot's row: the row holds
// the call's first element on every rank, and a later piece of a split call is as far past it
// on every rank as a.input is past ours. Not ready while the row is still zero. The row is
// eight words of our own memory, the same for every thread: one broadcast load each.
struct SlotInputs {
  const void* p[kMaxWorld];
  bool ready;
};

AR_DEVICE SlotInputs slot_inputs(const RegisteredArgs& r) {
  SlotInputs s;
  const unsigned long long mine = r.slot[r.a.rank];
  s.ready = mine != 0;
  const unsigned long long delta = reinterpret_cast<unsigned long long>(r.a.input) - mine;
#pragma unroll
  for (int k = 0; k < kMaxWorld; ++k)
    s.p[k] = k < int(r.a.world) && s.ready ? reinterpret_cast<const void*>(r.slot[k] + delta) : nullptr;
  return s;
}

// Vector v of rank `rank`'s input, whole: a partial last vector is zero-padded as
// stage_input pads it, so the sums (and the bits) are the staged kernels'.
template <typename T>
AR_DEVICE uint4 load_input(const void* const* inputs, const Geometry<T>& g, int rank, u64 v) {
  const uint4* in = static_cast<const uint4*>(inputs[rank]);
  return v < g.full ? load_peer(in + v) : load_partial<T>(in + v, g.tail);
}

template <typename T>
AR_DEVICE uint4 reduce_inputs(const Args& a, const void* const* inputs, const Geometry<T>& g, u64 v) {
  uint4 raw[kMaxWorld];
#pragma unroll
  for (int k = 0; k < kMaxWorld; ++k)
    if (k < int(a.world)) raw[k] = load_input<T>(inputs, g, k, v);
  return sum_in_rank_order<T>(a, raw);
}

// The registered kernels' bodies take the inputs apart from the arguments: the kernel
// parameter's own array on the common path (read where it is, as before), the slot row's on a
// graph slot.
template <typename T, template <typename> class Body>
__device__ void registered_kernel(const RegisteredArgs& r) {
  if (r.slot == nullptr) {
    Body<T>::run(r, r.inputs, true);
  } else {
    const SlotInputs s = slot_inputs(r);
    Body<T>::run(r, s.p, s.ready);
  }
}

// Entry barrier, every rank's input reduced straight into our output, closing barrier. Not
// split when larger than the workspace: it touches none of it but the header and the flags.
template <typename T>
struct OneshotRegistered {
  static AR_DEVICE void run(const RegisteredArgs& r, const void* const* inputs, bool ready) {
    const Args& a = r.a;
    CallEntry c;
    if (!enter_call(a, c)) return;
    const Geometry<T> g(a.n);

    if (!registered_entry(r, c, ready)) return;

    const u64 stride = (u64)grid_dim_x() * kThreads;
    auto input = [&](int k, u64 v) { return load_peer(static_cast<const uint4*>(inputs[k]) + v); };
    for (u64 v = reduce_pairs<T>(a, g, (u64)c.b * kThreads + thread_x(), stride, input); v < g.nvec; v += stride)
      store_output<T>(a, g, v, reduce_inputs<T>(a, inputs, g, v));

    // Nobody reads our input past this point, so our stream may overwrite it once we return.
    if (!barrier</*Release=*/false>(a, c, false, /*describe=*/false)) return;
    finish_call(c);
  }
};

template <typename T>
__device__ void oneshot_registered(const RegisteredArgs& r) {
  registered_kernel<T, OneshotRegistered>(r);
}

// Entry barrier, reduce-scatter from every rank's input into our `reduced`, barrier (after it
// no rank reads inputs), all-gather from the owners' `reduced` as twoshot() does. Pieces of a
// call larger than the workspace as for the staged kernel: `reduced` holds the piece.
template <typename T>
struct TwoshotRegistered {
  static AR_DEVICE void run(const RegisteredArgs& r, const void* const* inputs, bool ready) {
    const Args& a = r.a;
    CallEntry c;
    if (!enter_call(a, c)) return;
    const Geometry<T> g(a.n);
    const u64 stride = (u64)grid_dim_x() * kThreads;
    const u64 first = (u64)c.b * kThreads + thread_x();
    const u64 sv = (g.nvec + a.world - 1) / a.world;

    if (!registered_entry(r, c, ready)) return;

    const u64 lo = (u64)a.rank * sv, hi = min_u64(lo + sv, g.nvec);
    uint4* reduced = reinterpret_cast<uint4*>(reduced_of(c.self, a));
    for (u64 v = lo / stride * stride + first; v < hi; v += stride)
      if (v >= lo) reduced[v] = reduce_inputs<T>(a, inputs, g, v);
    if (!barrier(a, c, false, /*describe=*/false)) return;

    gather_reduced<T>(a, g, first, stride, sv);

    finish_call(c);
  }
};

template <typename T>
__device__ void twoshot_registered(const RegisteredArgs& r) {
  registered_kernel<T, TwoshotRegistered>(r);
}

// The roofline a measurement is compared against: the plain copy the hardware can do, in the
// same run and on the same buffers' sizes. Any launch shape.
AR_DEVICE void copy_vectors(const uint4* src, uint4* dst, u64 n_vec) {
  const u64 stride = (u64)grid_dim_x() * block_dim_x();
  for (u64 i = block_x() * (u64)block_dim_x() + thread_x(); i < n_vec; i += stride)
    dst[i] = src[i];
}

}  // namespace ar
