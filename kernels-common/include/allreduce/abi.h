// The ABI between the exact kernels (exact.h) and the host: launch shape, workspace layout,
// the Control block and the kernel arguments. The same on every vendor: the structs hold only
// fixed-width integers and 64-bit pointers, which x86_64/aarch64 hosts, NVPTX and AMDGCN lay
// out identically, and the asserts below check it on each compiler.
//
// The host side is the GPU engine's `abi` module (Rust), one copy for every vendor: every
// struct and offset below is mirrored there with the same asserts. Change both or neither.
//
// Launch contract (every kernel but the copy): grid = G blocks, G <= kMaxBlocks and the SAME
// on every rank and for every call of a communicator; block = kThreads threads; one rank's
// calls are ordered on one stream (the header below is not safe against two concurrent
// calls of the same rank). Input and output are 16-byte aligned and n * sizeof(T) <= max_bytes.
#pragma once

#include "allreduce/shim.h"

namespace ar {

constexpr int kMaxWorld = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
// 16 CUDA warps or 8 AMD wavefronts. Threads 0..kMaxWorld-1 are the barrier's talkers (one
// peer each), and they all sit in the first warp/wave on both.
static_assert(kThreads % kWarpSize == 0 && kMaxWorld <= kWarpSize, "launch shape");

// Per-rank workspace, one device allocation:
//   [0, 4096)            Header (zeroed at creation; only this rank's own kernels touch it)
//   [kFlagsOffset, ..)   uint32_t flags[kMaxBlocks][kMaxWorld]; flags[b][src] is written by
//                        rank src's block b (zeroed at creation)
//   [kDescOffset, ..)    uint64_t desc[2][kMaxBlocks][kMaxWorld]: what rank src's block b
//                        says this call is (length, dtype, strategy, path), by call parity
//   [kDesc2Offset, ..)   uint64_t desc2[2][kMaxBlocks][kMaxWorld]: the registered kernels'
//                        second word (registration and offset), by call parity
//   kStagingOffset:      staging[2][max_bytes], indexed by call parity
//   +2*max_bytes:        reduced[max_bytes], two-shot owners' rounded shards, indexed by the
//                        global byte offset
// max_bytes is a multiple of 256 (the host rounds it), so every region is 256-byte aligned.
struct Header {
  uint32_t epoch[kMaxBlocks];  // last barrier epoch of block b (see sync.h)
  uint32_t calls[kMaxBlocks];  // calls block b has completed; its parity picks the staging
  // Non-zero once any rank of the group timed out: set by that rank in every peer's header.
  // In device memory, not host memory, because every kernel reads it: a host-mapped word is a
  // PCIe round trip per block (and, behind a virtualised IOMMU, a slow one).
  uint32_t abort;
  // Set by block b when the ranks disagreed on a call, cleared when block b starts a call's
  // first piece: the later pieces of a call larger than the workspace (kDescContinued) are
  // skipped after a disagreement, by every rank alike, however many pieces each thinks the
  // call has.
  uint32_t skip[kMaxBlocks];
};
constexpr unsigned long long kHeaderBytes = 4096;
constexpr unsigned long long kFlagsOffset = 4096;
constexpr unsigned long long kDescOffset = 8192;
constexpr unsigned long long kDesc2Offset = 16384;
constexpr unsigned long long kStagingOffset = 24576;
static_assert(sizeof(Header) == 772 && sizeof(Header) <= kHeaderBytes, "Header");
static_assert(offsetof(Header, abort) == 512, "Header");
static_assert(kFlagsOffset + kMaxBlocks * kMaxWorld * sizeof(uint32_t) <= kDescOffset, "flags");
static_assert(kDescOffset + 2 * kMaxBlocks * kMaxWorld * sizeof(uint64_t) <= kDesc2Offset, "desc");
static_assert(kDesc2Offset + 2 * kMaxBlocks * kMaxWorld * sizeof(uint64_t) <= kStagingOffset, "desc2");

// Call descriptors. The host encodes (n << 16 | dtype << 12 | strategy << 8 | precision << 4
// | 1), with kDescRegistered or-ed in on the registered path; a rank whose arguments were refused on the host still launches, with kDescRejected
// and n = 0, so its peers learn of it at the first barrier instead of timing out.
constexpr unsigned long long kDescRejected = 2;
// Or-ed into the descriptor of every piece but the first of a call the host splits because it
// is larger than the workspace (the descriptor otherwise names the whole call).
constexpr unsigned long long kDescContinued = 4;
// Set in the descriptor of a call that reads its inputs in place from registered memory
// (RegisteredArgs): the path is part of what the ranks compare, so ranks that took different
// paths skip the call together instead of reading what was never staged.
constexpr unsigned long long kDescRegistered = 8;

// Or-ed in by the kernels (never the host) into every descriptor word they write, on calls
// whose bit 1 of calls[b] is clear (exact.h, call_tag): it tells this call's words from the
// stale ones of two calls back. The host keeps bit 63 of both words clear.
constexpr unsigned long long kDescTag = 1ull << 63;

struct Control {        // host-mapped pinned memory, zeroed at creation
  unsigned int error;   // 0 ok, kErrorTimeout, kErrorMismatch, kErrorAborted (cas_sys, see below)
  unsigned int rank;    // timeout: the rank whose wait timed out; mismatch: the peer that differs
  unsigned int block;   // its block
  unsigned int epoch;   // the epoch it waited for / of the call
  unsigned long long waited_ns;
  unsigned long long mine;    // mismatch: this rank's descriptor
  unsigned long long theirs;  // mismatch: the peer's; timeout: kTimeoutInFused or 0 (exact)
};
// What a timeout's `theirs` holds when a fused kernel's poll timed out: the host then reads
// the call tags, not the barrier flags, to tell which ranks never arrived.
constexpr unsigned long long kTimeoutInFused = 1;
constexpr unsigned int kErrorTimeout = 1;
// Not fatal: every rank of the call saw the same descriptors and skipped it. The host clears
// it once reported; a timeout (which leaves ranks out of step) is never cleared.
constexpr unsigned int kErrorMismatch = 2;
// Fatal, like a timeout: this rank's kernel left a call because the group's abort word was
// set (a peer timed out). In a group of processes the peer's timeout is recorded only in
// that peer's Control; without this one the host here would see a clean stream and take a
// half-written output for a result.
constexpr unsigned int kErrorAborted = 3;
// Not fatal, like kErrorMismatch: the ranks entered a fused call (fused.h) with different
// shapes and every rank skipped it; the next call refills the buffer its pushes landed in.
// `rank` is the peer that differs, `epoch` the fused call, `mine`/`theirs` the descriptors.
constexpr unsigned int kErrorFusedMismatch = 4;
static_assert(sizeof(Control) == 40, "Control");
static_assert(offsetof(Control, error) == 0 && offsetof(Control, rank) == 4, "Control");
static_assert(offsetof(Control, block) == 8 && offsetof(Control, epoch) == 12, "Control");
static_assert(offsetof(Control, waited_ns) == 16 && offsetof(Control, mine) == 24, "Control");
static_assert(offsetof(Control, theirs) == 32, "Control");

// Passed by value. Only input, output and n change between calls, so a captured graph stays
// valid: everything per-call that must change (epochs, parity) is in device memory.
struct Args {
  const void* input;
  void* output;
  unsigned long long n;         // elements
  char* peers[kMaxWorld];       // every rank's workspace base, rank order; peers[rank] is ours
  Control* control;             // this rank's
  unsigned long long max_bytes;
  unsigned long long timeout_ns;
  unsigned int rank;
  unsigned int world;           // 1..kMaxWorld
  unsigned long long desc;      // this call's descriptor (see kDescRejected)
};
static_assert(sizeof(Args) == 128, "Args");
static_assert(offsetof(Args, input) == 0 && offsetof(Args, output) == 8, "Args");
static_assert(offsetof(Args, n) == 16 && offsetof(Args, peers) == 24, "Args");
static_assert(offsetof(Args, control) == 88, "Args");
static_assert(offsetof(Args, max_bytes) == 96 && offsetof(Args, timeout_ns) == 104, "Args");
static_assert(offsetof(Args, rank) == 112 && offsetof(Args, world) == 116, "Args");
static_assert(offsetof(Args, desc) == 120, "Args");

// The registered kernels' parameter (exact.h, oneshot_registered / twoshot_registered): the
// staged kernels' Args, every rank's input of this call (memory every rank registered, read in
// place by the peers), and a second descriptor word naming the registration and the offset in
// it (the host encodes id << 40 | (offset / 16) << 2 with id < 2^23; its low two bits are clear,
// which tells the host a reported mismatch of this word from one of `desc`). Fixed for the
// life of a registration like the rest of Args, so a captured graph replays correctly.
//
// A call captured into a graph before its inputs were registered names a graph slot instead
// (`slot` non-null, `inputs` unused): a row of kMaxWorld device addresses in this rank's slot
// table, every rank's input of the call in rank order, which the host fills after capture
// (register_graph_buffers, as vLLM registers graph buffers) and the kernel reads at every
// replay. A row still zero says the graph runs before its buffers were registered: the ranks
// then skip the call together and the host reports it (kDesc2Unregistered).
struct RegisteredArgs {
  Args a;
  const void* inputs[kMaxWorld];  // rank order; inputs[a.rank] == a.input
  unsigned long long desc2;
  const unsigned long long* slot;  // null, or this call's row of the graph slot table
};
static_assert(sizeof(RegisteredArgs) == 208, "RegisteredArgs");
static_assert(offsetof(RegisteredArgs, inputs) == 128, "RegisteredArgs");
static_assert(offsetof(RegisteredArgs, desc2) == 192, "RegisteredArgs");
static_assert(offsetof(RegisteredArgs, slot) == 200, "RegisteredArgs");

// The second word a rank publishes for a graph slot whose row was never filled: registration
// 0, which names no registration (ids start at 1), so every peer's word differs from it.
constexpr unsigned long long kDesc2Unregistered = 0;

}  // namespace ar
