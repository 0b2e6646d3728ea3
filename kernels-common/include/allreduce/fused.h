// Lamport all-reduce fused with residual add + RMSNorm (+ FP8 E4M3 with a scale per token):
// the kernel bodies for every vendor. kernels-cuda/fused.cu and kernels-hip/fused.hip wrap
// them in extern "C" kernels. Semantics (what every output holds, the -0.0 rule, the
// tolerance of the norm) are allreduce_core::fused's module docs; the host side of this ABI
// is crates/backend-cuda/src/fused.rs.
//
// Lamport (TensorRT-LLM's allReduceFusionKernels.cu, FlashInfer's trtllm_allreduce_fusion):
// every element of the receive buffers is pre-filled with -0.0, a value no sender ever
// writes (inputs that are -0.0 are pushed as +0.0). A sender pushes 16-byte vectors straight
// into the receivers' buffers; a receiver polls its own buffer until no element of the vector
// it needs is -0.0 any more. The data is its own flag: no barrier, no flag word, one hop.
// Buffers come in threes: call k writes buffer k % 3 and, before reading, refills buffer
// (k - 1) % 3 (its own, which peers wrote in call k - 1) with -0.0. (A two-shot instead
// clears each vector peers pushed to it right after reading it, while the line is still in
// L2. Its reduced rows are the one part peers read rather than write: their owner refills
// them only after every peer's tag of call k shows it left call k - 1; refill_reduced.)
// Peers write that buffer again only in call k + 2, which they cannot start before finishing
// call k + 1, which needs our call k + 1 pushes, which our stream orders after this kernel: so
// no peer write can meet our refill. (Two buffers would not do: a peer may start call k + 1,
// writing buffer (k + 1) % 2 = (k - 1) % 2, while we still refill it in call k.)
//
// State that changes per call (the call count, whose remainder picks the buffer, and the
// previous call's shape, which says what to refill) lives in device memory, one copy per
// block, advanced by the kernel: a captured CUDA graph replays correctly. Every block of every
// rank runs every call, so all copies agree.
//
// Ranks that disagree on a call (tokens, hidden, pattern, dtype, one-shot or two-shot) must
// not sum mismatched rows, nor wait until the deadline: each rank sends every peer a 16-byte
// tag per call (the call count + 1 and its descriptor) into a small area at the end of the
// current buffer, and every block checks all tags before it reads any peer data. The tag area
// needs no refill: a tag is recognised by its call count, and a peer rewrites the same tag
// slot only three calls later, which it cannot reach before we finish this one. Ranks that
// disagree skip the call together (every block of every rank compares the same tags) and the
// group stays usable (kErrorFusedMismatch, reported like the exact kernels' kErrorMismatch):
// the skipped call's pushes, of whatever shape each peer had, stay in buffer k % 3, so the
// next call refills that whole buffer (refill_after_skip), and only once its tags have
// arrived: a peer's tag of call k + 1 is sent after its call k kernel completed, so none of
// its call k pushes is still in flight.
//
// Every poll has the deadline of sync.h: every kSpinsBeforeCheck polls it reads the group's
// abort word and the clock; past the deadline it records the failure in this rank's Control
// and sets the abort word of every rank, exactly like the exact kernels' barrier.
//
// Launch contract: grid = the communicator's G blocks (the same on every rank and call; all
// ranks' grids co-resident, since blocks poll data other ranks' blocks push); block =
// kThreads. hidden * sizeof(T) <= kThreads * kMaxVecs * 16, hidden a multiple of one vector;
// every buffer 16-byte aligned.
#pragma once

#include "allreduce/abi.h"
#include "allreduce/shim.h"
#include "allreduce/sync.h"
#include "allreduce/vec.h"

namespace ar {
namespace fused {

constexpr int kMaxVecs = 4;  // 16-byte vectors of one row per thread: a row is held in registers
constexpr int kPushUnroll = 4;  // input vectors each thread loads before pushing them
constexpr uint32_t kPatternAllReduce = 0, kPatternNorm = 1, kPatternNormFp8 = 2, kPatternNormFp8Static = 3;
// A rank whose arguments the host refused launches with this pattern and no rows (the host's
// REJECTED_PATTERN_CODE): its tag matches no call, so every rank skips the call.
constexpr uint32_t kPatternRejected = 15;

// One block's call state; kMaxBlocks of them per rank (the workspace's "flag" region).
struct BlockState {
  uint32_t calls;        // calls this block has run: calls % 3 is this call's buffer
  uint32_t prev_tokens;  // rows of the previous call (what to refill)
  uint32_t prev_twoshot; // whether the previous call was two-shot (which slots it wrote), or
                         // kPrevSkipped: the ranks disagreed on it (refill_after_skip)
  uint32_t prev_self;    // whether the previous call pushed into our own slot `rank`
};
static_assert(sizeof(BlockState) == 16 && kMaxBlocks * sizeof(BlockState) == 1024, "BlockState");
constexpr uint32_t kPrevSkipped = 2;

// Passed by value (__grid_constant__ on CUDA). Null output pointers are outputs not asked for.
// One Lamport buffer (of three, `comm_bytes` apart) holds world + 1 slots of `max_elems`
// elements: slot s receives rank s's rows; slot `world` holds the rows this rank reduced in a
// two-shot call, which every rank reads from there.
struct FusedKernelArgs {
  const void* input;       // tokens x hidden T; for the unfused norm kernel: the all-reduce output
  void* allreduce_out;
  const void* residual_in;
  void* residual_out;
  void* norm_out;
  uint8_t* quant_out;
  float* scale;            // pattern 2: per-token scales written; 3: the caller's static scale, read
  const void* gamma;       // hidden T
  char* lamport[kMaxWorld];  // every rank's Lamport base, rank order
  char* ws[kMaxWorld];       // every rank's exact-kernel workspace (its Header holds the abort word)
  BlockState* state;       // this rank's
  Control* control;        // this rank's
  u64 comm_bytes;          // bytes of one of the three Lamport buffers
  u64 max_elems;           // elements of one slot (max_tokens * hidden)
  u64 timeout_ns;
  uint32_t tokens, hidden, rank, world;
  uint32_t pattern;
  float eps;
  float weight_bias;       // added to gamma (f32) when non-zero: FlashInfer's weight_bias
  uint32_t tail;           // push.h: elements in the last vector (0: whole); 0 elsewhere
};
static_assert(sizeof(FusedKernelArgs) == 264, "FusedKernelArgs");
static_assert(offsetof(FusedKernelArgs, weight_bias) == 256, "FusedKernelArgs");
static_assert(offsetof(FusedKernelArgs, lamport) == 64 && offsetof(FusedKernelArgs, ws) == 128, "FusedKernelArgs");
static_assert(offsetof(FusedKernelArgs, state) == 192 && offsetof(FusedKernelArgs, comm_bytes) == 208, "FusedKernelArgs");
static_assert(offsetof(FusedKernelArgs, tokens) == 232 && offsetof(FusedKernelArgs, pattern) == 248, "FusedKernelArgs");

// ---- Lamport vectors ---------------------------------------------------------------------------

// -0.0 in T's bits, per 32-bit word of a vector: the "not written yet" sentinel.
template <typename T> struct Sentinel;
template <> struct Sentinel<float> {
  static AR_DEVICE bool any(uint32_t w) { return w == 0x80000000u; }
  static AR_DEVICE uint32_t plus_zero(uint32_t w) { return w == 0x80000000u ? 0u : w; }
};
template <typename T> struct Sentinel16 {
  static AR_DEVICE bool any(uint32_t w) { return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u; }
  static AR_DEVICE uint32_t plus_zero(uint32_t w) {
    if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
    if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
    return w;
  }
};
template <> struct Sentinel<ar_half> : Sentinel16<ar_half> {};
template <> struct Sentinel<ar_bf16> : Sentinel16<ar_bf16> {};

template <typename T>
AR_DEVICE bool has_sentinel(const uint4& v) {
  typedef Sentinel<T> S;
  return S::any(v.x) || S::any(v.y) || S::any(v.z) || S::any(v.w);
}

// -0.0 -> +0.0 in every element: what may be pushed, and the canonical all-reduce result.
template <typename T>
AR_DEVICE uint4 plus_zero(const uint4& v) {
  typedef Sentinel<T> S;
  return make_uint4(S::plus_zero(v.x), S::plus_zero(v.y), S::plus_zero(v.z), S::plus_zero(v.w));
}

template <typename T>
AR_DEVICE uint4 sentinel_vector() {
  const uint32_t w = sizeof(T) == 4 ? 0x80000000u : 0x80008000u;
  return make_uint4(w, w, w, w);
}

// Polled loads must not be served from a stale L1 line, and pushes must not be split: one
// volatile 16-byte access each (ld/st.volatile.global.v4). A torn vector would still be safe
// (every element is checked), only slower.
AR_DEVICE uint4 ld_volatile(const uint4* p) {
#if AR_HIP
  // HIP: peers' buffers must be fine-grained (uncached) memory, as for the exact kernels.
  return *reinterpret_cast<const volatile uint4*>(p);
#else
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}

AR_DEVICE void st_volatile(uint4* p, const uint4& v) {
#if AR_HIP
  *reinterpret_cast<volatile uint4*>(p) = v;
#else
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
#endif
}

// Ask for a line in L1 ahead of a load whose address is known before the data it waits for:
// the epilogue's residual and gamma loads then cost an L1 hit instead of an L2 round trip
// after the poll. No-op on HIP.
AR_DEVICE void prefetch_l1(const void* p) {
#if AR_HIP
  (void)p;
#else
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// ---- IEEE arithmetic the host reference repeats ------------------------------------------------

AR_DEVICE float div_rn(float a, float b) {
#if AR_HIP
  return a / b;  // correctly rounded: clang's HIP default (-fhip-fp32-correctly-rounded-divide-sqrt)
#else
  return __fdiv_rn(a, b);
#endif
}

AR_DEVICE float sqrt_rn(float a) {
#if AR_HIP
  return __builtin_sqrtf(a);
#else
  return __fsqrt_rn(a);
#endif
}

AR_DEVICE float max_f(float a, float b) { return a > b ? a : b; }

// allreduce_core::codec::f32_to_e4m3, bit for bit: nearest even (subnormals too), saturating
// to +-448, NaN -> 0x7F, and no -0 code (0x80 never comes out).
AR_DEVICE uint32_t f32_to_e4m3(float x) {
  const uint32_t bits = as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fu;
  const uint32_t sign = (bits >> 24) & 0x80u;
  const float a = as_float(bits & 0x7fffffffu);
  uint32_t mag;
  if (a >= 448.0f) {
    mag = 0x7eu;
  } else if (a < 0.015625f) {
    // Subnormal codes are k * 2^-9; a * 512 is exact, rounded to the nearest even integer.
#if AR_HIP
    mag = static_cast<uint32_t>(__builtin_rintf(a * 512.0f));
#else
    mag = __float2uint_rn(a * 512.0f);
#endif
  } else {
    const uint32_t b = as_uint(a);
    mag = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return mag == 0 ? 0u : (sign | mag);
}

// ---- Block reductions --------------------------------------------------------------------------

AR_DEVICE float shfl_xor(float v, int mask) {
#if AR_HIP
  const int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  return as_float(static_cast<uint32_t>(
      __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, static_cast<int>(as_uint(v)))));
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

constexpr int kWarps = kThreads / kWarpSize;

// The butterfly of a warp: every lane ends with the warp's total (or max).
template <bool kMax>
AR_DEVICE float warp_reduce(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    const float o = shfl_xor(v, m);
    v = kMax ? max_f(v, o) : v + o;
  }
  return v;
}

// Sum (or max) over the block of each of kMaxVecs values, the same totals in every thread.
// Deterministic: a butterfly in each warp, then every thread combines the warps' totals in warp
// order. `scratch` holds kMaxVecs floats per warp and is free again on return.
template <bool kMax>
AR_DEVICE void block_reduce(float (&v)[kMaxVecs], float* scratch) {
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) v[i] = warp_reduce<kMax>(v[i]);
  const unsigned warp = thread_x() / kWarpSize;
  if (thread_x() % kWarpSize == 0) {
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i) scratch[i * kWarps + warp] = v[i];
  }
  sync_block();
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    float total = scratch[i * kWarps];
    for (int w = 1; w < kWarps; ++w) total = kMax ? max_f(total, scratch[i * kWarps + w]) : total + scratch[i * kWarps + w];
    v[i] = total;
  }
  sync_block();  // everyone has read scratch before the next reduction writes it
}
constexpr int kScratch = kMaxVecs * (kThreads / kWarpSize);

// ---- Deadlines ---------------------------------------------------------------------------------

AR_DEVICE uint32_t* abort_word(char* ws) { return &reinterpret_cast<Header*>(ws)->abort; }

AR_DEVICE void report_timeout(const FusedKernelArgs& a, uint32_t calls, u64 waited) {
  Control* c = a.control;
  if (cas_sys(&c->error, 0u, kErrorTimeout) == 0u) {
    c->rank = a.rank;
    c->block = block_x();
    c->epoch = calls;
    c->waited_ns = waited;
    c->theirs = kTimeoutInFused;
  }
  for (unsigned r = 0; r < a.world; ++r) st_release_sys(abort_word(a.ws[r]), 1u);
  fence_system();
}

// Poll *p until `ready` holds. False once the deadline passed or the group aborted: the
// caller stops polling and the block leaves at its next sync_block_or.
template <typename Ready>
AR_DEVICE bool poll_until(const uint4* p, uint4& v, const FusedKernelArgs& a, uint32_t calls, const Ready& ready) {
  v = ld_volatile(p);
  if (ready(v)) return true;
  const u64 start = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = ld_volatile(p);
    if (ready(v)) return true;
    if (spins % kSpinsBeforeCheck != 0) continue;
    if (ld_relaxed_sys(abort_word(a.ws[a.rank])) != 0) {
      record_aborted(a.control, a.rank, block_x());
      return false;
    }
    const u64 waited = global_timer_ns() - start;
    if (waited > a.timeout_ns) {
      report_timeout(a, calls, waited);
      return false;
    }
  }
}

template <typename T>
struct Written {
  AR_DEVICE bool operator()(const uint4& v) const { return !has_sentinel<T>(v); }
};

// Poll until no element of *p is the sentinel.
template <typename T>
AR_DEVICE bool poll(const uint4* p, uint4& v, const FusedKernelArgs& a, uint32_t calls) {
  return poll_until(p, v, a, calls, Written<T>());
}

template <typename T>
AR_DEVICE uint4* slot(const FusedKernelArgs& a, char* base, uint32_t buffer, uint32_t s);

// The world size a kernel instance is compiled for: W > 0 fixes it (2, 4, 8: arrays sized to
// it, loops fully unrolled, fewer registers), W == 0 reads it from the arguments (any world up
// to kMaxWorld).
template <int W>
AR_DEVICE uint32_t world_of(const FusedKernelArgs& a) { return W > 0 ? uint32_t(W) : a.world; }
template <int W>
struct Ranks { static constexpr int kN = W > 0 ? W : kMaxWorld; };

// Vector v of every rank's slot: all world loads in flight at once, then a poll only for the
// ones not there yet (polling one rank after the other would cost world round trips).
// own_input: our own vector comes from our input, not from slot `rank` (own_input() below).
template <typename T, int W>
AR_DEVICE bool poll_all(const FusedKernelArgs& a, uint32_t buffer, u64 v, uint4 (&raw)[Ranks<W>::kN],
                        uint32_t calls, bool own_input) {
  char* self = a.lamport[a.rank];
  const int world = int(world_of<W>(a));
  const int own = own_input ? int(a.rank) : -1;
#pragma unroll
  for (int r = 0; r < Ranks<W>::kN; ++r) {
    if (r >= world) continue;
    raw[r] = r == own ? plus_zero<T>(static_cast<const uint4*>(a.input)[v])
                      : ld_volatile(slot<T>(a, self, buffer, r) + v);
  }
#pragma unroll
  for (int r = 0; r < Ranks<W>::kN; ++r)
    if (r < world && r != own && has_sentinel<T>(raw[r]) &&
        !poll<T>(slot<T>(a, self, buffer, r) + v, raw[r], a, calls))
      return false;
  return true;
}

// ---- Addressing --------------------------------------------------------------------------------

template <typename T>
AR_DEVICE uint4* slot(const FusedKernelArgs& a, char* base, uint32_t buffer, uint32_t s) {
  return reinterpret_cast<uint4*>(base + buffer * a.comm_bytes + s * a.max_elems * sizeof(T));
}

// The tag area of a buffer: its last kMaxWorld 16-byte tags, tag s from rank s. At the end,
// not after the world + 1 slots, so the host's warm-up launch (world 1) writes its tags where
// real calls do and never into a slot.
constexpr u64 kTagBytes = kMaxWorld * 16;
AR_DEVICE uint4* tags(const FusedKernelArgs& a, char* base, uint32_t buffer) {
  return reinterpret_cast<uint4*>(base + (buffer + 1ull) * a.comm_bytes - kTagBytes);
}

// ---- Call agreement ----------------------------------------------------------------------------

template <typename T> struct DTypeCode;  // the host's DType codes (the GPU engine's `abi` module)
template <> struct DTypeCode<float> { static constexpr u64 kCode = 1; };
template <> struct DTypeCode<ar_half> { static constexpr u64 kCode = 2; };
template <> struct DTypeCode<ar_bf16> { static constexpr u64 kCode = 3; };

// What this rank says the call is; decoded on the host by allreduce_core::fused::describe_desc.
template <typename T>
AR_DEVICE u64 call_desc(const FusedKernelArgs& a, bool twoshot) {
  return (u64)a.tokens << 32 | (u64)(a.hidden & 0xffffffu) << 8 | (u64)(a.pattern & 0xfu) << 4 |
         (u64)twoshot << 3 | DTypeCode<T>::kCode << 1 | 1u;
}

struct TagOfCall {
  uint32_t want;
  AR_DEVICE bool operator()(const uint4& v) const { return v.x == want; }
};

// Block 0's threads 0..world-1 send our tag to one peer each (ourselves included), before any
// data: a plain store like the data pushes, which the receivers poll for.
// The world is the launch's (a.world), not an instance's compiled W: the host's warm-up runs
// the W-specialised kernels with world 1 and no rows.
AR_DEVICE void send_tag(const FusedKernelArgs& a, uint32_t calls, uint32_t buffer, u64 desc) {
  if (block_x() != 0 || thread_x() >= a.world) return;
  st_volatile(tags(a, a.lamport[thread_x()], buffer) + a.rank,
              make_uint4(calls + 1u, 0u, uint32_t(desc), uint32_t(desc >> 32)));
}

// Not fatal: every rank sees the same tags and skips the call; the host reports it once and
// clears it, as the exact kernels' kErrorMismatch. A timeout or abort recorded first is kept.
// A refusing rank records nothing: its caller has the error already (as kDescRejected).
AR_DEVICE void record_mismatch(const FusedKernelArgs& a, uint32_t peer, uint32_t calls, u64 mine, u64 theirs) {
  Control* c = a.control;
  if (a.pattern == kPatternRejected) return;
  if (cas_sys(&c->error, 0u, kErrorFusedMismatch) == 0u) {
    c->rank = peer;
    c->block = block_x();
    c->epoch = calls;
    c->mine = mine;
    c->theirs = theirs;
    fence_system();
  }
}

// Every block, before it reads peer data: wait for every rank's tag of this call and compare
// it with ours. The same in every thread: kAgree, kDisagree (every rank's blocks see the same
// tags, so all skip the call), or kLeave (the deadline passed or the group aborted).
// `report` false: a disagreement is not recorded in our Control (push.h: a rank whose call
// the host refused has already told its caller).
enum Agreement { kAgree, kDisagree, kLeave };
AR_DEVICE Agreement tags_agree(const FusedKernelArgs& a, uint32_t calls, uint32_t buffer, u64 desc,
                               bool report = true) {
  bool leave = false, differs = false;
  const uint32_t peer = thread_x();
  if (peer < a.world) {
    uint4 t;
    const uint4* tag = tags(a, a.lamport[a.rank], buffer) + peer;
    if (!poll_until(tag, t, a, calls, TagOfCall{calls + 1u})) {
      leave = true;
    } else {
      const u64 theirs = (u64)t.w << 32 | t.z;
      if (theirs != desc) {
        if (report) record_mismatch(a, peer, calls, desc, theirs);
        differs = true;
      }
    }
  }
  if (!sync_block_or(leave || differs)) return kAgree;
  return sync_block_or(leave) ? kLeave : kDisagree;
}

// ---- The row epilogue: residual add, RMSNorm, FP8 ----------------------------------------------

// A row's FP8 scale (what the per-token scales hold) and the factor its codes are taken at, from the
// row's largest magnitude m.
AR_DEVICE void fp8_scale(float m, float& scale, float& mul) {
  const bool usable = m > 0.0f && m <= 3.4028234e38f;
  scale = usable ? div_rn(m, 448.0f) : 1.0f;
  mul = usable ? div_rn(448.0f, m) : 1.0f;
}

// The E4M3 codes of vector v (T elements already normalized), at quant_out's vector v.
template <typename T>
AR_DEVICE void store_e4m3(uint8_t* quant_out, u64 v, const uint4& x4, float mul) {
  constexpr int E = Packed<T>::kElems;
  float x[E];
  Packed<T>::to_f32(x4, x);
  uint32_t w[E / 4];
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    w[q] = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[q] |= f32_to_e4m3(x[4 * q + k] * mul) << (8 * k);
  }
  uint32_t* dst = reinterpret_cast<uint32_t*>(quant_out + v * E);
#pragma unroll
  for (int q = 0; q < E / 4; ++q) dst[q] = w[q];
}

// A block handles its rows (t = block, block + G, ...) in batches: a row takes vpr =
// ceil(row_vecs / kThreads) vectors per thread, so kMaxVecs / vpr rows fit in a thread's
// registers at once, and their loads and polls overlap. Slot i of a thread is row
// t0 + (i / vpr) * G of the batch, vector j = thread_x() + (i % vpr) * kThreads.
struct Batch {
  uint32_t t0, vpr, rows;
  u64 row_vecs;
  AR_DEVICE Batch(uint32_t t0_, u64 row_vecs_)
      : t0(t0_), vpr(uint32_t((row_vecs_ + kThreads - 1) / kThreads)), rows(0), row_vecs(row_vecs_) {
    rows = kMaxVecs / vpr;
  }
  AR_DEVICE uint32_t row_of(int i) const { return i / vpr; }
  AR_DEVICE uint32_t token(int i) const { return t0 + row_of(i) * grid_dim_x(); }
  AR_DEVICE u64 vec(int i) const { return thread_x() + (i % vpr) * kThreads; }
  AR_DEVICE bool valid(int i, uint32_t tokens) const {
    return row_of(i) < rows && token(i) < tokens && vec(i) < row_vecs;
  }
  // Whether slots i and k hold the same row (true for k == i).
  AR_DEVICE bool same_row(int i, int k) const { return row_of(i) == row_of(k); }
  AR_DEVICE uint32_t stride() const { return rows * grid_dim_x(); }
};

// Gamma's vector j in f32, with the weight bias added when there is one (fused::weight on the
// host: untouched at 0, so a -0.0 gamma keeps its sign).
template <typename T>
AR_DEVICE void gamma_f32(const FusedKernelArgs& a, u64 j, float (&g)[Packed<T>::kElems]) {
  Packed<T>::to_f32(static_cast<const uint4*>(a.gamma)[j], g);
  if (a.weight_bias != 0.0f) {
#pragma unroll
    for (int k = 0; k < Packed<T>::kElems; ++k) g[k] = g[k] + a.weight_bias;
  }
}

// Before waiting for a batch: prefetch the residual and gamma vectors its epilogue will read.
template <typename T>
AR_DEVICE void prefetch_epilogue(const FusedKernelArgs& a, const Batch& bt) {
  if (a.pattern == kPatternAllReduce) return;
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    if (!bt.valid(i, a.tokens)) continue;
    if (a.residual_in) prefetch_l1(static_cast<const uint4*>(a.residual_in) + (u64)bt.token(i) * bt.row_vecs + bt.vec(i));
    if (uint32_t(i) < bt.vpr) prefetch_l1(static_cast<const uint4*>(a.gamma) + bt.vec(i));
  }
}

// The epilogue of a batch, once this thread's all-reduced vectors are in `row`. Every thread
// of the block calls it (block reductions). The per-row sum of squares is, for every slot of
// the row in slot order, the block's deterministic sum of that slot: the same arithmetic for
// any batch size, so the fused kernels and the unfused norm kernel give the same bits. Loops
// over slots are unrolled with guards so `row` stays in registers.
template <typename T>
AR_DEVICE void epilogue(const FusedKernelArgs& a, const Batch& bt, uint4 (&row)[kMaxVecs], float* scratch) {
  constexpr int E = Packed<T>::kElems;
  bool valid[kMaxVecs];
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) valid[i] = bt.valid(i, a.tokens);
  if (a.allreduce_out) {
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i)
      if (valid[i]) static_cast<uint4*>(a.allreduce_out)[(u64)bt.token(i) * bt.row_vecs + bt.vec(i)] = row[i];
  }
  if (a.pattern == kPatternAllReduce) return;

  // Residual add, rounded once to T; the sum of squares is taken of the rounded values (what
  // an RMSNorm kernel reading residual_out would see). Without a residual, of the all-reduce
  // output itself.
  float part[kMaxVecs];
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    part[i] = 0.0f;
    if (!valid[i]) continue;
    const u64 v = (u64)bt.token(i) * bt.row_vecs + bt.vec(i);
    float x[E], r[E];
    if (a.residual_in) {
      Packed<T>::to_f32(row[i], x);
      Packed<T>::to_f32(static_cast<const uint4*>(a.residual_in)[v], r);
#pragma unroll
      for (int k = 0; k < E; ++k) x[k] += r[k];
      row[i] = Packed<T>::from_f32(x);
      if (a.residual_out) static_cast<uint4*>(a.residual_out)[v] = row[i];
    }
    Packed<T>::to_f32(row[i], x);
#pragma unroll
    for (int k = 0; k < E; ++k) part[i] += x[k] * x[k];
  }
  block_reduce<false>(part, scratch);
  float inv[kMaxVecs];
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k)
      if (bt.same_row(i, k)) ss += part[k];
    inv[i] = div_rn(1.0f, sqrt_rn(div_rn(ss, float(a.hidden)) + a.eps));
  }

  float amax[kMaxVecs];
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    amax[i] = 0.0f;
    if (!valid[i]) continue;
    const u64 j = bt.vec(i);
    float x[E], g[E];
    Packed<T>::to_f32(row[i], x);
    gamma_f32<T>(a, j, g);
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = (x[k] * inv[i]) * g[k];
    row[i] = Packed<T>::from_f32(x);
    if (a.norm_out) static_cast<uint4*>(a.norm_out)[(u64)bt.token(i) * bt.row_vecs + j] = row[i];
    Packed<T>::to_f32(row[i], x);
#pragma unroll
    for (int k = 0; k < E; ++k) amax[i] = max_f(amax[i], x[k] < 0.0f ? -x[k] : x[k]);
  }
  if (a.pattern == kPatternNormFp8Static) {
    // The caller's scale, read at run time (a graph replays with its current value); one
    // IEEE division, as TensorRT-LLM's 1.f / *scale_factor and fused::epilogue.
    const float mul = div_rn(1.0f, *a.scale);
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i)
      if (valid[i]) store_e4m3<T>(a.quant_out, (u64)bt.token(i) * bt.row_vecs + bt.vec(i), row[i], mul);
    return;
  }
  if (a.pattern != kPatternNormFp8) return;

  block_reduce<true>(amax, scratch);
#pragma unroll
  for (int i = 0; i < kMaxVecs; ++i) {
    if (!valid[i]) continue;
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k)
      if (bt.same_row(i, k)) m = max_f(m, amax[k]);
    float scale, mul;
    fp8_scale(m, scale, mul);
    store_e4m3<T>(a.quant_out, (u64)bt.token(i) * bt.row_vecs + bt.vec(i), row[i], mul);
    if (bt.vec(i) == 0) a.scale[bt.token(i)] = scale;
  }
}

// ---- Kernel bodies -----------------------------------------------------------------------------

// Sum of the world's vectors in f32, rank order from rank 0's value (the exact kernels'
// arithmetic), rounded once to T, -0.0 as +0.0.
template <typename T, int W>
AR_DEVICE uint4 reduce(const uint4 (&raw)[Ranks<W>::kN], uint32_t world) {
  constexpr int E = Packed<T>::kElems;
  float acc[E], x[E];
  Packed<T>::to_f32(raw[0], acc);
#pragma unroll
  for (int r = 1; r < Ranks<W>::kN; ++r) {
    if (r < int(world)) {
      Packed<T>::to_f32(raw[r], x);
#pragma unroll
      for (int k = 0; k < E; ++k) acc[k] += x[k];
    }
  }
  return plus_zero<T>(Packed<T>::from_f32(acc));
}

struct Call {
  uint32_t calls, buffer, stale, prev_tokens;
  bool prev_twoshot, prev_self, prev_skipped;
};

// Read this block's state (every thread). No abort check here, unlike the exact kernels: it
// would put a load and a block barrier in front of the first push, and a kernel launched after
// an abort leaves at its first poll's check anyway (its pushes land in buffers of a group that
// must be rebuilt).
AR_DEVICE void begin(const FusedKernelArgs& a, Call& c) {
  const BlockState s = a.state[block_x()];
  c.calls = s.calls;
  c.buffer = s.calls % 3;
  c.stale = (s.calls + 2) % 3;
  c.prev_tokens = s.prev_tokens;
  c.prev_skipped = s.prev_twoshot == kPrevSkipped;
  c.prev_twoshot = s.prev_twoshot != 0 && !c.prev_skipped;
  c.prev_self = s.prev_self != 0;
}

// The block's polls are over: the stream's next kernel, when launched with PDL, may now be
// scheduled (it waits in pdl_wait() until this grid has completed). Not earlier: a waiting
// grid holds its SM slots, and until every block of ours is past its polls a peer's grid
// may still need slots to get its pushes out.
AR_DEVICE void finish(const FusedKernelArgs& a, const Call& c, bool twoshot, bool self_pushed) {
  pdl_trigger();
  sync_block();  // every thread read the state in begin()
  if (thread_x() == 0) {
    BlockState s;
    s.calls = c.calls + 1;
    s.prev_tokens = a.tokens;
    s.prev_twoshot = twoshot;
    s.prev_self = self_pushed;
    a.state[block_x()] = s;
  }
}

// The ranks disagreed on this call: it ends here on every block of every rank, and the next
// call refills this call's buffer whole.
AR_DEVICE void finish_skipped(const Call& c, const FusedKernelArgs& a) {
  pdl_trigger();
  sync_block();
  if (thread_x() == 0) {
    BlockState s;
    s.calls = c.calls + 1;
    s.prev_tokens = 0;
    s.prev_twoshot = kPrevSkipped;
    s.prev_self = 0;
    a.state[block_x()] = s;
  }
}

// A thread's place in a grid-stride loop over vectors (pushes, refills): first, first +
// stride, ...
struct Spread {
  u64 first, stride;
};

// The one-shot's order: blocks counted from the last. Rows go to blocks from the first
// (Batch: row t to block t % G), so in a call with fewer rows than blocks the blocks that wait
// for rows and run the epilogue (block reductions, three outputs) are not also the ones that
// issue the pushes and refill stores, which one SM's store path carried before, on the
// critical path of every small call (H200, graph mode, 1-8 tokens: 5-10% less time per call).
// Whole blocks: spreading a small call's stores thinner, ceil(n / G) vectors (whole warps)
// per block, cost 0.1-0.5 us per call on the H200 at 2 and 4 ranks (2026-12-04,
// docs/history/benchmarks-2026-12.md).
AR_DEVICE Spread spread_from_last() {
  return Spread{(u64)(grid_dim_x() - 1u - block_x()) * kThreads + thread_x(),
                (u64)grid_dim_x() * kThreads};
}
// The two-shot keeps block order and whole blocks: the reversal there cost 2-4% at 64-128
// tokens on 4 ranks (docs/history/benchmarks-2026-12.md).
AR_DEVICE Spread spread_in_order() {
  return Spread{(u64)block_x() * kThreads + thread_x(), (u64)grid_dim_x() * kThreads};
}
template <bool kFromLast>
AR_DEVICE Spread spread() { return kFromLast ? spread_from_last() : spread_in_order(); }

// Vectors [0, n) of `rows` back to the -0.0 sentinel.
template <typename T, bool kFromLast>
AR_DEVICE void fill_sentinel(uint4* rows, u64 n) {
  const uint4 s = sentinel_vector<T>();
  const Spread sp = spread<kFromLast>();
  for (u64 v = sp.first; v < n; v += sp.stride) rows[v] = s;
}

// The rows [lo, hi) this rank owned in the previous call, if it was a two-shot.
AR_DEVICE void prev_owned(const FusedKernelArgs& a, const Call& c, uint32_t world, u64& lo, u64& hi) {
  const u64 per = (c.prev_tokens + world - 1) / world;
  lo = min_u64(a.rank * per, c.prev_tokens);
  hi = min_u64(lo + per, c.prev_tokens);
}

// Refill with -0.0 what the previous call's peers wrote into our stale buffer, if it was a
// one-shot: every rank's slot for all its rows (our own only if we pushed into it). We read
// those slots ourselves in that call, and peers write them again only in call k + 2, so this
// may run before the tags agree, overlapping the pushes in flight. A two-shot clears what it
// read as it reads it (twoshot, phase 2).
template <typename T, int W, bool kFromLast>
AR_DEVICE void refill(const FusedKernelArgs& a, const Call& c) {
  if (c.prev_twoshot || c.prev_skipped) return;
  const uint32_t world = world_of<W>(a);
  constexpr int E = Packed<T>::kElems;
  const u64 row_vecs = a.hidden / E;
  char* self = a.lamport[a.rank];
  for (uint32_t src = 0; src < world; ++src)
    if (src != a.rank || c.prev_self)  // a call that read its own rows from its input
                                       // left our own slot unwritten
      fill_sentinel<T, kFromLast>(slot<T>(a, self, c.stale, src), (u64)c.prev_tokens * row_vecs);
}

// After a two-shot call: its reduced rows, which we kept in our slot `world` and every peer
// read from there, back to -0.0. Only once the tags agree: a peer's tag of this call proves it
// left the previous one, so none still reads them (before, a peer in its last phase could
// read a refilled vector and wait for a value that never comes).
template <typename T, int W, bool kFromLast>
AR_DEVICE void refill_reduced(const FusedKernelArgs& a, const Call& c) {
  if (!c.prev_twoshot) return;
  const uint32_t world = world_of<W>(a);
  const u64 row_vecs = a.hidden / Packed<T>::kElems;
  u64 lo, hi;
  prev_owned(a, c, world, lo, hi);
  uint4* reduced = slot<T>(a, a.lamport[a.rank], c.stale, world);
  fill_sentinel<T, kFromLast>(reduced + lo * row_vecs, (hi - lo) * row_vecs);
}

// After a call the ranks skipped: every slot of its buffer (our stale one now) back to -0.0,
// whatever shape each peer pushed. Only once this call's tags have all arrived (see the
// header). Costs a pass over the buffer, once per disagreement.
template <typename T, int W, bool kFromLast>
AR_DEVICE void refill_after_skip(const FusedKernelArgs& a, const Call& c) {
  if (!c.prev_skipped) return;
  const uint32_t world = world_of<W>(a);
  for (uint32_t s = 0; s <= world; ++s)
    fill_sentinel<T, kFromLast>(slot<T>(a, a.lamport[a.rank], c.stale, s), a.max_elems / Packed<T>::kElems);
}

// What every kernel does once the tags have arrived: the refills that wait for them, and on a
// disagreement the end of the call. False: the block leaves (the call was skipped, or failed).
template <typename T, int W, bool kFromLast>
AR_DEVICE bool after_tags(const FusedKernelArgs& a, const Call& c, Agreement ag) {
  if (ag == kLeave) return false;
  refill_after_skip<T, W, kFromLast>(a, c);
  // Every peer's tag of this call shows it left the previous one, agreeing or not.
  refill_reduced<T, W, kFromLast>(a, c);
  if (ag == kAgree) return true;
  finish_skipped(c, a);
  return false;
}

// One round of phase 1's input loads: vectors v0 + u * stride, -0.0 pushed as +0.0.
template <typename T>
AR_DEVICE void load_round(const FusedKernelArgs& a, u64 v0, u64 nvec, u64 stride, uint4 (&x)[kPushUnroll]) {
#pragma unroll
  for (int u = 0; u < kPushUnroll; ++u)
    if (v0 + u * stride < nvec) x[u] = plus_zero<T>(static_cast<const uint4*>(a.input)[v0 + u * stride]);
}

// Whether the one-shot reduces our own rows from our input rather than from a push into our
// own slot: 1 / world of the message less to push, refill and poll (H200, 2 ranks: 9% less
// per call at 64 tokens of hidden 8192). Not in place (allreduce_out == input): there a row's
// reducer may write the row's output while another block of ours has yet to read that input
// row to push it to the peers; the push to ourselves, which the reducer waits for, is what
// orders the two. Not in oneshot_split either: its small calls wait on latency, and there a
// row's blocks reading the input themselves cost 0.3-0.7 us per call at 4 ranks (probably
// a load from memory where the slot our own pushers had just written hits in L2). Per rank
// and call (only we write and read our own slot); BlockState::prev_self tells the next
// call's refill.
AR_DEVICE bool own_input(const FusedKernelArgs& a) { return a.allreduce_out != a.input; }

// The one-shot's phases 1 and 2, shared by oneshot and oneshot_split: push every row to
// every rank (but ourselves when `own`: own_input), refill the stale buffer, agree on the
// call. False when the block must leave.
template <typename T, int W>
AR_DEVICE bool oneshot_exchange(const FusedKernelArgs& a, Call& c, bool own) {
  const uint32_t world = world_of<W>(a);
  constexpr int E = Packed<T>::kElems;
  const u64 row_vecs = a.hidden / E, nvec = (u64)a.tokens * row_vecs;
  const Spread sp = spread_from_last();
  const u64 stride = sp.stride, first = sp.first;
  // The first round of input loads goes out before the call state is read: the pushes (what
  // the peers wait for) need both, and neither needs the other, so one memory latency comes
  // before the first push instead of two. After send_tag they could not be hoisted: its store
  // is a compiler barrier. (H200: 0.3-0.5 us less on two-shot calls of 64-128 tokens; within
  // noise on small one-shot calls, whose time is elsewhere.)
  uint4 x[kPushUnroll];
  pdl_wait();  // launched with PDL: the previous kernel's writes (our input, the state)
  load_round<T>(a, first, nvec, stride, x);
  begin(a, c);
  const u64 desc = call_desc<T>(a, false);
  send_tag(a, c.calls, c.buffer, desc);

  // ---- Phase 1: push our rows into slot `rank` of every rank's current buffer, kPushUnroll
  // loads in flight per thread (the grid is small, so one load at a time would leave this
  // phase latency-bound).
  for (u64 v0 = first; v0 < nvec; v0 += kPushUnroll * stride) {
    if (v0 != first) load_round<T>(a, v0, nvec, stride, x);
#pragma unroll
    for (int u = 0; u < kPushUnroll; ++u) {
      if (v0 + u * stride >= nvec) continue;
      for (uint32_t p = 0; p < world; ++p)
        if (p != a.rank || !own)
          st_volatile(slot<T>(a, a.lamport[p], c.buffer, a.rank) + v0 + u * stride, x[u]);
    }
  }
  // ---- Phase 2: refill the stale buffer (overlaps the peers' pushes in flight), then agree.
  refill<T, W, true>(a, c);
  return after_tags<T, W, true>(a, c, tags_agree(a, c.calls, c.buffer, desc));
}

// One-shot: push every row to every rank; each rank reduces every row itself, in rank order,
// and runs the epilogue. One hop.
template <typename T, int W>
__device__ void oneshot(const FusedKernelArgs& a) {
  const uint32_t world = world_of<W>(a);
  __shared__ float scratch[kScratch];
  constexpr int E = Packed<T>::kElems;
  const u64 row_vecs = a.hidden / E;
  const bool own = own_input(a);
  Call c;
  if (!oneshot_exchange<T, W>(a, c, own)) return;

  // ---- Phase 3: per batch of rows (rows of one block: t = block, block + G, ...), wait for
  // every rank's vectors, reduce, epilogue.
  for (Batch bt(block_x(), row_vecs); bt.t0 < a.tokens; bt.t0 += bt.stride()) {
    uint4 row[kMaxVecs];
    bool ok = true;
    prefetch_epilogue<T>(a, bt);
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i) {
      if (!bt.valid(i, a.tokens) || !ok) continue;
      // All ranks' vectors, then the sum in rank order from rank 0's value: every rank
      // computes the same bits.
      uint4 raw[Ranks<W>::kN];
      ok = poll_all<T, W>(a, c.buffer, (u64)bt.token(i) * row_vecs + bt.vec(i), raw, c.calls, own);
      if (ok) row[i] = reduce<T, W>(raw, world);
    }
    if (sync_block_or(!ok)) return;
    epilogue<T>(a, bt, row, scratch);
  }
  finish(a, c, false, !own);
}

// Two-shot: rows are split among ranks (rank o owns rows [o * per, (o + 1) * per)); every
// rank pushes each row to its owner, the owner reduces it into its own slot `world`, every
// rank reads (polls) each row there and runs the epilogue on every row. Two hops, but each
// rank receives 2 x the message instead of world x. The owner takes its own share of a row
// from its input, not from a push to itself: 1 / world of the message less to write and to
// refill per call. (The one-shot keeps pushing to itself: there a row's reducer may finish
// the row while another block has yet to read that input row and push it, which an
// in-place call, allreduce_out == input, would have overwritten.)
template <typename T, int W>
__device__ void twoshot(const FusedKernelArgs& a) {
  const uint32_t world = world_of<W>(a);
  __shared__ float scratch[kScratch];
  constexpr int E = Packed<T>::kElems;
  const u64 row_vecs = a.hidden / E, nvec = (u64)a.tokens * row_vecs;
  const Spread sp = spread_in_order();
  const u64 stride = sp.stride, first = sp.first;
  const u64 per = (a.tokens + world - 1) / world;
  uint4 x[kPushUnroll];
  pdl_wait();  // as in oneshot_exchange
  load_round<T>(a, first, nvec, stride, x);  // before the state, as in oneshot
  Call c;
  begin(a, c);
  const u64 desc = call_desc<T>(a, true);
  send_tag(a, c.calls, c.buffer, desc);

  // ---- Phase 1: each row to its owner's slot `rank`. The owner is tracked incrementally
  // (no 64-bit division per vector).
  {
    uint32_t owner = 0;
    for (u64 v0 = first; v0 < nvec; v0 += kPushUnroll * stride) {
      if (v0 != first) load_round<T>(a, v0, nvec, stride, x);
#pragma unroll
      for (int u = 0; u < kPushUnroll; ++u) {
        const u64 v = v0 + u * stride;
        if (v >= nvec) continue;
        while (v >= (owner + 1ull) * per * row_vecs) ++owner;
        if (owner != a.rank) st_volatile(slot<T>(a, a.lamport[owner], c.buffer, a.rank) + v, x[u]);
      }
    }
  }
  refill<T, W, false>(a, c);
  if (!after_tags<T, W, false>(a, c, tags_agree(a, c.calls, c.buffer, desc))) return;

  // ---- Phase 2: reduce our rows into our own slot `world`, where every rank reads them.
  char* self = a.lamport[a.rank];
  const u64 lo = min_u64(a.rank * per, a.tokens) * row_vecs, hi = min_u64(a.rank * per + per, a.tokens) * row_vecs;
  bool ok = true;
  for (u64 v = lo + first; v < hi && ok; v += stride) {
    uint4 raw[Ranks<W>::kN];
    ok = poll_all<T, W>(a, c.buffer, v, raw, c.calls, true);
    if (!ok) break;
    st_volatile(slot<T>(a, self, c.buffer, world) + v, reduce<T, W>(raw, world));
    // Clear what we just read (only we read it; peers write it again only in call k + 3, as
    // for refill): the line is still in L2, dirty from the push, so memory sees one write
    // back of it where a refill pass in the next call wrote it back a second time.
#pragma unroll
    for (int r = 0; r < Ranks<W>::kN; ++r)
      if (r < int(world) && r != int(a.rank))
        slot<T>(a, self, c.buffer, r)[v] = sentinel_vector<T>();
  }
  if (sync_block_or(!ok)) return;

  // ---- Phase 3: every row from its owner's slot `world` (a batch's loads in flight
  // together), then the epilogue. Pulled, not pushed: each reduced row is written once and
  // refilled once, by its owner, where pushing it to every rank wrote it and refilled it
  // world times (2 of the call's ~10 message sizes of memory traffic per rank).
  const uint32_t per32 = uint32_t(per);  // <= tokens
  auto reduced_vec = [&](const Batch& bt, int i) {
    const uint32_t t = bt.token(i);
    return slot<T>(a, a.lamport[t / per32], c.buffer, world) + (u64)t * row_vecs + bt.vec(i);
  };
  for (Batch bt(block_x(), row_vecs); bt.t0 < a.tokens; bt.t0 += bt.stride()) {
    uint4 row[kMaxVecs];
    prefetch_epilogue<T>(a, bt);
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i)
      if (bt.valid(i, a.tokens)) row[i] = ld_volatile(reduced_vec(bt, i));
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i)
      if (bt.valid(i, a.tokens) && ok && has_sentinel<T>(row[i])) ok = poll<T>(reduced_vec(bt, i), row[i], a, c.calls);
    if (sync_block_or(!ok)) return;
    epilogue<T>(a, bt, row, scratch);
  }
  finish(a, c, true, false);
}

// ---- One-shot over thread-block clusters (CUDA, sm_90 and later) -----------------------------

// At few rows one block, on one SM, carried a whole row after the pushes: the polls of every
// rank's copy (world x the row), the residual and gamma loads, the two or three outputs; at
// hidden 8192 that is (world + 4) x 16 KiB through one SM's load/store path, on the critical
// path of every small call. oneshot_split shares each row among the C blocks of a cluster
// (the host picks C in 2, 4, 8, with vpr <= C and every row its own cluster). Block q of a
// cluster takes warps [q * 16 / C, (q + 1) * 16 / C) of every 512-vector slot of the row, so
// each thread holds one vector, and the blocks exchange per-warp sums through distributed
// shared memory: every block folds them warps in order, then slots in order, exactly the
// arithmetic of block_reduce in the one-block kernels, so the norm keeps the same bits as
// oneshot and the unfused norm kernel (tests compare them by value).
//
// Every block of a cluster passes every cluster barrier, whatever failed: a block that left
// early would leave its cluster waiting at a barrier that has no deadline. A failure (tags
// that disagree, a poll past its deadline or aborted) travels with the sums as a flag, and the
// whole cluster leaves together after the barrier. Writers store into every peer's shared
// memory before the barrier and read only their own after it, so no block touches a peer's
// shared memory once it may have exited.
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AR_CLUSTERS 1
namespace cluster {
AR_DEVICE uint32_t rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
AR_DEVICE uint32_t size() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
AR_DEVICE uint32_t id() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
AR_DEVICE uint32_t count() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// Release what this thread wrote (peers' shared memory included), wait for every thread of
// the cluster, acquire what they wrote.
AR_DEVICE void sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// *p in block `block` of the cluster (p: this block's copy of a __shared__ variable).
AR_DEVICE void store(const void* p, uint32_t block, uint32_t v) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(block));
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}
}  // namespace cluster

// Per-warp totals of a row, [row parity][slot][warp of the slot]: two rows' worth, so a block
// one row ahead never overwrites what a peer still folds.
struct SplitExchange {
  float sum[2][kMaxVecs][kWarps];
  float amax[2][kMaxVecs][kWarps];
  uint32_t bad[2][kMaxVecs][kWarps];
};

// Lane b < C of a warp stores v at p in block b of the cluster: the C copies at once.
AR_DEVICE void publish(const void* p, uint32_t lane, uint32_t C, uint32_t v) {
  if (lane < C) cluster::store(p, lane, v);
}
#else
#define AR_CLUSTERS 0
#endif

template <typename T, int W>
__device__ void oneshot_split(const FusedKernelArgs& a) {
#if AR_CLUSTERS
  __shared__ SplitExchange ex;
  constexpr int E = Packed<T>::kElems;
  const uint32_t world = world_of<W>(a);
  const u64 row_vecs = a.hidden / E;
  const bool own = false;  // see own_input
  Call c;
  bool ok = oneshot_exchange<T, W>(a, c, own);  // no early return: see above

  const uint32_t C = cluster::size(), q = cluster::rank();
  const uint32_t per = kWarps / C;  // warps of a slot per block
  const uint32_t lw = thread_x() / kWarpSize, lane = thread_x() % kWarpSize;
  const uint32_t vpr = uint32_t((row_vecs + kThreads - 1) / kThreads);
  const uint32_t slot = lw / per, wi = q * per + lw % per;
  const bool owner = slot < vpr;  // this warp holds warp wi of the row's slot `slot`
  const u64 j = (u64)slot * kThreads + wi * kWarpSize + lane;
  const bool valid = owner && j < row_vecs;
  const bool norm = a.pattern != kPatternAllReduce;
  uint32_t it = 0;
  for (uint32_t t = cluster::id(); t < a.tokens; t += cluster::count(), ++it) {
    const uint32_t par = it & 1u;
    const u64 v = (u64)t * row_vecs + j;
    if (valid && norm) {
      if (a.residual_in) prefetch_l1(static_cast<const uint4*>(a.residual_in) + v);
      prefetch_l1(static_cast<const uint4*>(a.gamma) + j);
    }
    uint4 x4 = make_uint4(0u, 0u, 0u, 0u);
    float part = 0.0f;
    if (valid && ok) {
      uint4 raw[Ranks<W>::kN];
      ok = poll_all<T, W>(a, c.buffer, v, raw, c.calls, own);
      if (ok) {
        x4 = reduce<T, W>(raw, world);
        if (a.allreduce_out) static_cast<uint4*>(a.allreduce_out)[v] = x4;
        if (norm) {
          // As epilogue(): rounded once to T, squares of the rounded values.
          float x[E], r[E];
          if (a.residual_in) {
            Packed<T>::to_f32(x4, x);
            Packed<T>::to_f32(static_cast<const uint4*>(a.residual_in)[v], r);
#pragma unroll
            for (int k = 0; k < E; ++k) x[k] += r[k];
            x4 = Packed<T>::from_f32(x);
            if (a.residual_out) static_cast<uint4*>(a.residual_out)[v] = x4;
          }
          Packed<T>::to_f32(x4, x);
#pragma unroll
          for (int k = 0; k < E; ++k) part += x[k] * x[k];
        }
      }
    }
    if (!norm) continue;  // no exchange: a failed block leaves after the loop

    const float wsum = warp_reduce<false>(part);
    const uint32_t bad = __any_sync(0xffffffffu, !ok);
    if (owner) {
      publish(&ex.sum[par][slot][wi], lane, C, as_uint(wsum));
      publish(&ex.bad[par][slot][wi], lane, C, bad);
    }
    cluster::sync();
    float ss = 0.0f;
    uint32_t any_bad = 0;
    for (uint32_t k = 0; k < vpr; ++k) {
      float total = ex.sum[par][k][0];
      any_bad |= ex.bad[par][k][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        total = total + ex.sum[par][k][w];
        any_bad |= ex.bad[par][k][w];
      }
      ss += total;
    }
    if (any_bad) return;  // the same flags in every block of the cluster: all leave
    const float inv = div_rn(1.0f, sqrt_rn(div_rn(ss, float(a.hidden)) + a.eps));

    float amax = 0.0f;
    if (valid) {
      float x[E], g[E];
      Packed<T>::to_f32(x4, x);
      gamma_f32<T>(a, j, g);
#pragma unroll
      for (int k = 0; k < E; ++k) x[k] = (x[k] * inv) * g[k];
      x4 = Packed<T>::from_f32(x);
      if (a.norm_out) static_cast<uint4*>(a.norm_out)[v] = x4;
      Packed<T>::to_f32(x4, x);
#pragma unroll
      for (int k = 0; k < E; ++k) amax = max_f(amax, x[k] < 0.0f ? -x[k] : x[k]);
    }
    if (a.pattern == kPatternNormFp8Static) {
      if (valid) store_e4m3<T>(a.quant_out, v, x4, div_rn(1.0f, *a.scale));  // as epilogue()
      continue;
    }
    if (a.pattern != kPatternNormFp8) continue;

    const float wmax = warp_reduce<true>(amax);
    if (owner) publish(&ex.amax[par][slot][wi], lane, C, as_uint(wmax));
    cluster::sync();
    float m = 0.0f;
    for (uint32_t k = 0; k < vpr; ++k) {
      float total = ex.amax[par][k][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) total = max_f(total, ex.amax[par][k][w]);
      m = max_f(m, total);
    }
    if (!valid) continue;
    float scale, mul;
    fp8_scale(m, scale, mul);
    store_e4m3<T>(a.quant_out, v, x4, mul);
    if (j == 0) a.scale[t] = scale;
  }
  if (sync_block_or(!ok)) return;
  finish(a, c, false, true);
#else
  (void)a;
#if !AR_HIP
  __trap();  // the host launches it only on devices with clusters (sm_90 and later)
#endif
#endif
}

// The unfused baseline's second kernel: residual add + RMSNorm (+ FP8) of an all-reduce output
// already in `input`; any grid. No state, no polling, no -0.0 rule.
template <typename T>
__device__ void norm_only(const FusedKernelArgs& a) {
  __shared__ float scratch[kScratch];
  constexpr int E = Packed<T>::kElems;
  const u64 row_vecs = a.hidden / E;
  for (Batch bt(block_x(), row_vecs); bt.t0 < a.tokens; bt.t0 += bt.stride()) {
    uint4 row[kMaxVecs];
    prefetch_epilogue<T>(a, bt);
#pragma unroll
    for (int i = 0; i < kMaxVecs; ++i)
      if (bt.valid(i, a.tokens)) row[i] = static_cast<const uint4*>(a.input)[(u64)bt.token(i) * row_vecs + bt.vec(i)];
    epilogue<T>(a, bt, row, scratch);
  }
}

}  // namespace fused
}  // namespace ar
