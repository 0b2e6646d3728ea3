// The lane groups of tests/emulated: the 32 / N lanes that code one block together, run on
// one CPU thread as fibers in lockstep, so that the codec source's cross-lane shuffles
// (__shfl_xor_sync, through the host shim) see their partners' values.
//
// Plain C++ and libc only (no C++ runtime library), so the test binary links the archive
// without libstdc++.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace ar_emu {

// One lane's work: everything lane q of the group does, for every block.
typedef void (*LaneBody)(void* job, int q);

// Runs body(job, q) for q = 0 .. lanes - 1 (lanes: 1, 2 or 4) as one group of lanes, on the
// calling thread. Lanes switch only inside a shuffle: lane 0 runs until its first shuffle,
// then lane 1, and so on; each reads its partner's value once every lane has offered its
// own. Returns 0, or -1 with a message in err when a lane faulted: a shuffle outside the
// group, lanes whose shuffles do not pair up (divergence: different counts, masks or
// blocks), blocks that made different numbers of shuffles (on the GPU a warp holds the groups
// of several blocks, and a full-mask shuffle waits for all of its lanes), or a misaligned
// access.
int run_group(int lanes, LaneBody body, void* job, char* err, size_t err_cap);

// The start of the segment being coded (fault reports give offsets from it).
void set_segment(const void* base);

// The block the running lane codes from now on (the shuffle records carry it, to name the
// block in a divergence report; the shuffles counted since the last call are the previous
// block's).
void set_block(uint64_t k);

}  // namespace ar_emu
