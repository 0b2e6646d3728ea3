// Fibers (ucontext) for the lane groups of lanes.h, and the shuffle the host shim's
// __shfl_xor_sync calls.
#include "lanes.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

extern "C" uint32_t ar_emu_shfl_xor(uint32_t v, int lane_mask);
extern "C" void ar_emu_fault(const char* what, const void* p, unsigned align);

namespace ar_emu {
namespace {

constexpr int kMaxLanes = 4;
constexpr size_t kStackBytes = 256 * 1024;

// What a lane offered at one of its shuffles.
struct Slot {
  uint32_t v;
  int mask;
  uint64_t seq, block;
};

struct Group {
  int lanes, current;
  LaneBody body;
  void* job;
  ucontext_t main, ctx[kMaxLanes];
  bool done[kMaxLanes];
  uint64_t seq[kMaxLanes], block[kMaxLanes];
  // Shuffles per block: a warp holds the groups of several blocks, and a full-mask
  // __shfl_xor_sync needs every lane of the warp, so every block must make the same number of
  // shuffles whatever its data (an empty block that skipped one hung the warp on the GPU).
  uint64_t block_start[kMaxLanes];
  bool in_block[kMaxLanes];
  bool per_block_known;
  uint64_t per_block, per_block_of;
  // By the parity of the shuffle's sequence number: a lane reads shuffle s after every lane
  // offered s, and no lane offers s + 2 before every lane has read s.
  Slot slot[2][kMaxLanes];
  bool failed;
  char msg[768];
};

thread_local Group* g_group = nullptr;
thread_local const char* g_segment = nullptr;

void fail(Group* g, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void fail(Group* g, const char* fmt, ...) {
  if (g->failed) return;
  g->failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->msg, sizeof g->msg, fmt, ap);
  va_end(ap);
}

// Lane q gives way to the next lane that has not finished (none: q goes on).
void yield(Group* g, int q) {
  for (int i = 1; i < g->lanes; ++i) {
    const int n = (q + i) % g->lanes;
    if (!g->done[n]) {
      g->current = n;
      swapcontext(&g->ctx[q], &g->ctx[n]);
      g->current = q;
      return;
    }
  }
}

// Lane q's block ends: its shuffle count must be every other block's.
void end_block(Group* g, int q) {
  if (!g->in_block[q]) return;
  const uint64_t made = g->seq[q] - g->block_start[q];
  if (!g->per_block_known) {
    g->per_block_known = true;
    g->per_block = made;
    g->per_block_of = g->block[q];
  } else if (made != g->per_block) {
    fail(g,
         "blocks diverge: block %llu made %llu shuffles, block %llu %llu (the groups of one warp code different "
         "blocks, and every lane of the warp must shuffle together)",
         (unsigned long long)g->per_block_of, (unsigned long long)g->per_block, (unsigned long long)g->block[q],
         (unsigned long long)made);
  }
}

void lane_entry(int q) {
  Group* g = g_group;
  g->body(g->job, q);
  end_block(g, q);
  g->done[q] = true;
  for (int i = 1; i < g->lanes; ++i) {
    const int n = (q + i) % g->lanes;
    if (!g->done[n]) {
      g->current = n;
      setcontext(&g->ctx[n]);
    }
  }
  setcontext(&g->main);
}

}  // namespace

int run_group(int lanes, LaneBody body, void* job, char* err, size_t err_cap) {
  if (lanes != 1 && lanes != 2 && lanes != 4) {
    snprintf(err, err_cap, "a group of %d lanes (1, 2 or 4)", lanes);
    return -1;
  }
  if (g_group != nullptr) {
    snprintf(err, err_cap, "run_group is not reentrant");
    return -1;
  }
  Group* g = static_cast<Group*>(calloc(1, sizeof(Group)));
  char* stacks = lanes > 1 ? static_cast<char*>(malloc(kStackBytes * lanes)) : nullptr;
  if (g == nullptr || (lanes > 1 && stacks == nullptr)) {
    free(g);
    free(stacks);
    snprintf(err, err_cap, "out of memory");
    return -1;
  }
  g->lanes = lanes;
  g->body = body;
  g->job = job;
  g_group = g;
  if (lanes == 1) {
    body(job, 0);
    end_block(g, 0);
  } else {
    for (int q = 0; q < lanes; ++q) {
      getcontext(&g->ctx[q]);
      g->ctx[q].uc_stack.ss_sp = stacks + kStackBytes * q;
      g->ctx[q].uc_stack.ss_size = kStackBytes;
      g->ctx[q].uc_link = &g->main;
      makecontext(&g->ctx[q], reinterpret_cast<void (*)()>(lane_entry), 1, q);
    }
    g->current = 0;
    swapcontext(&g->main, &g->ctx[0]);
    for (int q = 1; q < lanes; ++q)
      if (g->seq[q] != g->seq[0])
        fail(g, "lanes diverge: lane 0 made %llu shuffles, lane %d %llu", (unsigned long long)g->seq[0], q,
             (unsigned long long)g->seq[q]);
  }
  g_group = nullptr;
  const int rc = g->failed ? -1 : 0;
  if (g->failed) snprintf(err, err_cap, "%s", g->msg);
  free(stacks);
  free(g);
  return rc;
}

void set_segment(const void* base) { g_segment = static_cast<const char*>(base); }

void set_block(uint64_t k) {
  Group* g = g_group;
  if (g == nullptr) return;
  const int q = g->current;
  end_block(g, q);
  g->block[q] = k;
  g->block_start[q] = g->seq[q];
  g->in_block[q] = true;
}

}  // namespace ar_emu

using ar_emu::g_group;

extern "C" uint32_t ar_emu_shfl_xor(uint32_t v, int lane_mask) {
  ar_emu::Group* g = g_group;
  if (g == nullptr) {
    fprintf(stderr, "ar_emu: __shfl_xor_sync outside a lane group\n");
    abort();
  }
  const int q = g->current, p = q ^ lane_mask;
  if (lane_mask <= 0 || p >= g->lanes) {
    ar_emu::fail(g, "lane %d, block %llu: __shfl_xor_sync(xor %d) leaves its group of %d lane(s)", q,
                 (unsigned long long)g->block[q], lane_mask, g->lanes);
    return v;
  }
  const uint64_t s = g->seq[q]++;
  g->slot[s & 1][q] = ar_emu::Slot{v, lane_mask, s, g->block[q]};
  ar_emu::yield(g, q);
  const ar_emu::Slot& o = g->slot[s & 1][p];
  if (o.seq != s || o.mask != lane_mask || o.block != g->block[q])
    ar_emu::fail(g,
                 "lanes diverge: lane %d's shuffle #%llu (block %llu, xor %d) meets lane %d's shuffle #%llu "
                 "(block %llu, xor %d)",
                 q, (unsigned long long)s, (unsigned long long)g->block[q], lane_mask, p, (unsigned long long)o.seq,
                 (unsigned long long)o.block, o.mask);
  return o.v;
}

extern "C" void ar_emu_fault(const char* what, const void* p, unsigned align) {
  ar_emu::Group* g = g_group;
  if (g == nullptr) {
    fprintf(stderr, "ar_emu: %s at %p outside a lane group\n", what, p);
    abort();
  }
  // Offsets from the segment's start, which is aligned like a GPU allocation (256 bytes).
  const long long off = ar_emu::g_segment ? static_cast<const char*>(p) - ar_emu::g_segment : -1;
  ar_emu::fail(g, "lane %d, block %llu: %s at byte offset %lld of the segment (needs %u-byte alignment)", g->current,
               (unsigned long long)g->block[g->current], what, off, align);
}
