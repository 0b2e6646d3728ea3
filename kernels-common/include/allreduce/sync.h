// The per-block flag barrier every kernel in this project synchronises ranks with.
//
// Contract
// - One barrier per thread block: block b of rank r meets block b of every other rank. The
//   kernels give block b the same set of addresses ("class b") in every buffer on every rank,
//   so a block only ever needs its own peers to have arrived, never the whole grid.
// - Flags are u32 epochs that only grow, never reset (QuickReduce's flag_color idea). The
//   epoch counter lives in device memory and is advanced by the kernel, not the host, so a
//   captured CUDA graph replays correctly. At barrier k a rank stores e_k into each peer's
//   slot for it, then waits until its own slot for each peer holds at least e_k. A peer can be
//   at most one barrier ahead (it cannot pass k+1 before we reach it), so "at least" is needed
//   and enough; the comparison is on the signed difference so the counter may wrap.
// - Ordering: __syncthreads, then one thread per peer does a system-scope release store.
//   The CTA barrier makes every thread's earlier writes (the staged data) happen-before the
//   release, so a peer that acquires the flag sees them. The waiter does acquire loads, then
//   __syncthreads, which extends the acquire to the whole block before anyone reads peer data.
//   Reads also count: a peer's reads of our buffer before its release happen-before our
//   writes after we acquire it, which is what lets buffers be reused without a closing barrier.
//   (__syncthreads is shim.h's sync_block/sync_block_or. On HIP the same argument holds in
//   the scoped model clang's AMDGPU backend implements: the block barrier is wrapped in
//   workgroup release/acquire fences, and a system-scope release after an acquire is
//   cumulative over what that acquire saw.)
// - No spin without a way out (NCCL's checkAbort): every kSpinsBeforeCheck spins a waiter
//   looks at the group's abort word and at the clock. Past the deadline it reports (once per
//   block, through Flags::on_timeout) and the whole block leaves; so does every block of
//   every rank that then sees the abort word set. A block that left never touches the flags
//   again: after a timeout the group's workspaces are garbage and must be rebuilt.
// - All threads of the block must call it (it contains block barriers), with blockDim.x >= world.
#pragma once

#include "allreduce/abi.h"
#include "allreduce/shim.h"

namespace ar {

// Record in this rank's Control that block `block` left a call because the abort word was set.
// A timeout recorded first is kept (it names the rank that waited); an unreported mismatch is
// overwritten (the group is now out of step for good, which matters more).
AR_DEVICE void record_aborted(Control* c, unsigned rank, unsigned block) {
  uint32_t old = cas_sys(&c->error, 0u, kErrorAborted);
  if (old == kErrorMismatch && cas_sys(&c->error, kErrorMismatch, kErrorAborted) == kErrorMismatch) {
    old = 0u;
  }
  if (old != 0u) return;
  c->rank = rank;
  c->block = block;
}

constexpr int kSpinsBeforeCheck = 1024;

// Spins until `ready()` holds (it performs the load), looking at the group's abort word and at
// the clock every kSpinsBeforeCheck spins. False: the caller must leave; past the deadline
// `on_timeout(waited_ns)` has recorded why. One thread per wait; never spins unbounded.
// The clock starts at the first check, not at entry: most waits end within kSpinsBeforeCheck
// spins, and a timer read on every wait is a fixed cost of every small call; the deadline
// moves by those few microseconds.
template <typename Ready, typename OnTimeout>
AR_DEVICE bool spin_until(Ready ready, const uint32_t* abort, u64 timeout_ns, OnTimeout on_timeout) {
  u64 start = 0;
  for (uint32_t spins = 1; !ready(); ++spins) {
    if (spins % kSpinsBeforeCheck != 0) continue;
    if (ld_relaxed_sys(abort) != 0) return false;
    const u64 now = global_timer_ns();
    if (start == 0) start = now;
    if (now - start > timeout_ns) {
      on_timeout(now - start);
      return false;
    }
  }
  return true;
}

// Flags is the kernel's address map:
//   uint32_t* to_peer(int peer) const;          // peer's slot for this rank and block
//   const uint32_t* from_peer(int peer) const;  // this rank's slot for peer and block
//   void on_timeout(int peer, uint32_t epoch, u64 waited_ns) const;  // record the failure
//   void on_abort() const;  // record that this block left because the abort word was set
// `e` is the barrier's epoch: one more than the last barrier's of this block, which the caller
// keeps (in a register for the call, in its workspace header between calls).
// `abort` is the group's abort word; `leave_now` lets a caller fold in a check it made earlier
// (the kernels pass the abort word as read at kernel entry, so its latency overlaps phase 1).
// Returns false when the block must return at once (the result is the same in every thread).
// Release = false makes the flag a relaxed store and the waits relaxed loads: only for a
// barrier that publishes no data, whose sole job is "every peer has finished reading" (the
// registered one-shot's closing barrier). Loads whose values were consumed before the block
// barrier cannot see later writes, which is what that barrier promises; and a release at
// system scope waits for this block's stores to reach every peer, about a microsecond.
template <bool Release = true, typename Flags>
AR_DEVICE bool flag_barrier(const Flags& f, uint32_t e, int world, const uint32_t* abort,
                            u64 timeout_ns, bool leave_now) {
  // Orders this block's writes (and reads) before the release stores below.
  if (sync_block_or(leave_now)) {
    if (thread_x() == 0) f.on_abort();
    return false;
  }
  bool leave = false;
  const int peer = thread_x();
  if (peer < world) {
    if (Release)
      st_release_sys(f.to_peer(peer), e);
    else
      st_relaxed_sys(f.to_peer(peer), e);
    const uint32_t* slot = f.from_peer(peer);
    auto arrived = [&] {
      const uint32_t v = Release ? ld_acquire_sys(slot) : ld_relaxed_sys(slot);
      return static_cast<int32_t>(v - e) >= 0;
    };
    leave = !spin_until(arrived, abort, timeout_ns, [&](u64 waited) { f.on_timeout(peer, e, waited); });
  }
  // Extends the acquires to the block; also the point where one thread's failure becomes
  // everyone's.
  if (sync_block_or(leave)) {
    // After a timeout here this keeps the timeout's report; otherwise it is what tells the
    // host (a peer's report may be in another process).
    if (thread_x() == 0) f.on_abort();
    return false;
  }
  return true;
}

}  // namespace ar
