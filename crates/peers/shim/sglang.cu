// A C face for SGLang's custom all-reduce v2 (sglang/kernels/jit/csrc/distributed/
// custom_all_reduce.cuh, with the sgl_kernel and TVM-FFI headers it includes), so the bench can
// time its four kernels beside ours. The header is fetched by scripts/peers/fetch.sh and used
// unmodified: its kernels, its Lamport and barrier protocols, its PDL copy kernel and its
// `LaunchKernel`.
//
// What this file restates is SGLang's host side, which takes TVM-FFI objects
// (`AllReduceKernel<T, W, kUsePDL>::run` over a `Communicator` of a push and a pull plane):
// the planes here are plain pointers the caller allocated the way custom_all_reduce_v2.py
// allocates them, and `peers_sglang_all_reduce` makes, per call, the launches `run` makes: the
// same kernels, grids, PDL and copies, in the same order. Virtual ranks share one process, so
// every rank's workspace is a device pointer of this address space (SGLang exchanges them
// through torch symmetric memory). Multicast is not here: ranks of one GPU have no multicast
// object, and SGLang disables it (`num_mc_blocks = None`) where the symmetric allocation has
// none.
//
// Every function returns 0, or -1 with a message in `err`: no C++ exception crosses into Rust.

#include <cstdint>
#include <stdexcept>
#include <string>

#include "distributed/custom_all_reduce.cuh"
#include "guard.h"

using peers_shim::guarded;

namespace {

using sglang::device::distributed::Counter;
using sglang::device::distributed::PullWorkSpace;
using sglang::device::distributed::PushWorkSpace;
using sglang::device::distributed::Semaphore;

constexpr uint32_t kMaxWorld = 8;

// One rank's view of SGLang's `Communicator`: what `PushPlaneObj` and `PullPlaneObj` hold once
// their tensors are validated (communicator.cuh), and the pull launch width.
struct Planes {
  uint32_t rank;
  uint32_t world;
  uint8_t* push[kMaxWorld];  // every rank's 2 * world slots of slot_bytes, zeroed
  Counter* counter;          // this rank's per-block epoch counters, zeroed
  uint32_t push_blocks;      // the push grid: bound to the counter array
  int64_t slot_bytes;
  uint8_t* pull[kMaxWorld];     // every rank's pull workspace
  Semaphore* sems[kMaxWorld];   // every rank's per-block semaphores, zeroed
  uint32_t pull_blocks;         // the pull grid (`get_pull_blocks`)
  int64_t pull_bytes;
};

enum Algo { kOneShotPush = 0, kTwoShotPush = 1, kOneShotPull = 2, kTwoShotPull = 3 };

// `AllReduceKernel<T, kWorldSize, kUsePDL>::run` of custom_all_reduce.cuh, restated over
// `Planes`, for `kUsePDL` = true (SGLang's `is_arch_support_pdl()` on sm_90 and later).
// `graph_row`: the row of SGLang's graph pointer table this call reads (captured calls), or
// null (eager: the pull algorithms stage the input through the pull workspace).
template <typename T, uint32_t W>
void run(const Planes& p, cudaStream_t stream, int algo, const void* input, void* output,
         int64_t nbytes, void* const* graph_row, uint32_t threads) {
  using namespace sglang;
  using namespace sglang::host;
  constexpr bool kUsePDL = true;
  using vec_t = device::AlignedVector<packed_t<T>, 16 / (sizeof(T) * 2)>;
  if (p.world != W) throw std::runtime_error("world size mismatch");
  if (reinterpret_cast<intptr_t>(input) % 16 != 0 || nbytes % 16 != 0 || nbytes <= 0)
    throw std::runtime_error("SGLang's all-reduce takes whole, aligned 16-byte vectors");
  const auto num_vecs = static_cast<uint32_t>(nbytes / 16);
  const bool use_graph = graph_row != nullptr;

  if (algo == kOneShotPush || algo == kTwoShotPush) {
    if (use_graph) throw std::runtime_error("the push algorithms take no graph table");
    const bool two_shot = algo == kTwoShotPush;
    const auto chunk_vecs = div_ceil(num_vecs, W);
    // `PushPlaneObj::get_workspace`'s bound: the slice must fit a slot.
    const int64_t need = two_shot ? int64_t{2} * chunk_vecs * 16 : nbytes;
    if (need > p.slot_bytes)
      throw std::runtime_error(std::to_string(need) + " bytes escape the " +
                               std::to_string(p.slot_bytes) + "-byte push slot");
    PushWorkSpace<W> ws{{}, p.counter, nullptr, static_cast<uint32_t>(p.slot_bytes)};
    for (uint32_t i = 0; i < W; ++i) ws.workspaces[i] = p.push[i];
    const auto params = AllReducePushParams<W>{
        .input = input, .output = output, .num_vecs = num_vecs, .rank = p.rank, .ws = ws};
    const auto kernel = two_shot ? all_reduce_2shot_push_kernel<T, W, kUsePDL>
                                 : all_reduce_1shot_push_kernel<T, W, kUsePDL>;
    LaunchKernel(p.push_blocks, threads, stream).enable_pdl(kUsePDL)(kernel, params);
    return;
  }
  if (algo != kOneShotPull && algo != kTwoShotPull)
    throw std::runtime_error("algo " + std::to_string(algo) + ": want 0 to 3");
  if (!use_graph && nbytes > p.pull_bytes)
    throw std::runtime_error(std::to_string(nbytes) + " bytes escape the " +
                             std::to_string(p.pull_bytes) + "-byte pull workspace");
  // Only 2shot_pull from a graph table reduces in place (into every rank's input).
  const bool inplace = use_graph && algo == kTwoShotPull;
  PullWorkSpace<W> ws{{}, {}, nullptr, nullptr};
  for (uint32_t i = 0; i < W; ++i) {
    ws.semaphores[i] = p.sems[i];
    ws.workspaces[i] = p.pull[i];
  }
  const auto params = AllReducePullParams<W>{
      .output = inplace ? const_cast<void*>(input) : output,
      .num_vecs = num_vecs,
      .rank = p.rank,
      .graph_params = graph_row,
      .ws = ws};
  // `run`'s `cuda_memcpy`: its PDL copy kernel up to 8 MiB on Hopper, else cudaMemcpyAsync.
  const auto copy = [&](void* dst, const void* src) {
    if constexpr (SGL_ARCH_HOPPER_OR_GREATER) {
      constexpr int64_t threshold_MB = SGL_ARCH_BLACKWELL_OR_GREATER ? 1024 : 8;
      if (nbytes % device::kMaxVecBytes == 0 && nbytes <= threshold_MB * 1024 * 1024) {
        const uint32_t vecs = nbytes / device::kMaxVecBytes;
        LaunchKernel(div_ceil(vecs, 128u), 128u, stream)
            .enable_pdl(kUsePDL)(memcpy_kernel<device::kMaxVecBytes>, dst, src, vecs);
        return;
      }
    }
    CHECK_CUDA(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream));
  };
  using LS = LoadStoreImpl<vec_t, W, false>;
  using LS_GRAPH = LoadStoreImpl<vec_t, W, true>;
  uint8_t* local = p.pull[p.rank];
  if (!use_graph) copy(local, input);
  if (algo == kOneShotPull) {
    const auto kernel = use_graph ? all_reduce_1shot_pull_kernel<LS_GRAPH, T, W, kUsePDL>
                                  : all_reduce_1shot_pull_kernel<LS, T, W, kUsePDL>;
    LaunchKernel(p.pull_blocks, threads, stream).enable_pdl(kUsePDL)(kernel, params);
  } else {
    const auto kernel = use_graph ? all_reduce_2shot_pull_kernel<LS_GRAPH, T, W, kUsePDL>
                                  : all_reduce_2shot_pull_kernel<LS, T, W, kUsePDL>;
    LaunchKernel(p.pull_blocks, threads, stream).enable_pdl(kUsePDL)(kernel, params);
    if (!use_graph) copy(output, local);
  }
}

template <typename T>
void run_world(const Planes& p, cudaStream_t s, int algo, const void* in, void* out,
               int64_t nbytes, void* const* row, uint32_t threads) {
  switch (p.world) {
    case 2: return run<T, 2>(p, s, algo, in, out, nbytes, row, threads);
    case 3: return run<T, 3>(p, s, algo, in, out, nbytes, row, threads);
    case 4: return run<T, 4>(p, s, algo, in, out, nbytes, row, threads);
    case 5: return run<T, 5>(p, s, algo, in, out, nbytes, row, threads);
    case 6: return run<T, 6>(p, s, algo, in, out, nbytes, row, threads);
    case 7: return run<T, 7>(p, s, algo, in, out, nbytes, row, threads);
    case 8: return run<T, 8>(p, s, algo, in, out, nbytes, row, threads);
    default: throw std::runtime_error("world " + std::to_string(p.world) + ": want 2 to 8");
  }
}

}  // namespace

extern "C" {

// Bytes of one pull semaphore (a block's arrival slot) and of one push epoch counter.
size_t peers_sglang_semaphore_bytes() { return sizeof(Semaphore); }
size_t peers_sglang_counter_bytes() { return sizeof(Counter); }

// `push[r]`: rank r's push workspace (2 * world slots of `slot_bytes`), `counter`: this rank's
// `push_blocks` counters, `pull[r]`: rank r's pull workspace of `pull_bytes`, `sems[r]`: rank
// r's `pull_blocks` semaphores; everything but the pull workspaces zeroed before first use.
int peers_sglang_create(int world, int rank, void** push, void* counter, int push_blocks,
                        int64_t slot_bytes, void** pull, void** sems, int pull_blocks,
                        int64_t pull_bytes, void** out, char* err, size_t len) {
  return guarded(err, len, [&] {
    if (world < 2 || world > static_cast<int>(kMaxWorld) || rank < 0 || rank >= world)
      throw std::runtime_error("rank " + std::to_string(rank) + " of " + std::to_string(world) +
                               ": SGLang's kernels are built here for 2 to 8 ranks");
    if (push_blocks <= 0 || pull_blocks <= 0 || slot_bytes <= 0 || pull_bytes <= 0)
      throw std::runtime_error("empty plane");
    // `PushPlaneObj::get_workspace`: the kernels stride the double-buffered plane in 32 bits.
    if (2 * world * slot_bytes > int64_t{UINT32_MAX})
      throw std::runtime_error("push plane beyond the kernels' 32-bit offsets");
    auto* p = new Planes{};
    p->rank = rank;
    p->world = world;
    p->counter = static_cast<Counter*>(counter);
    p->push_blocks = push_blocks;
    p->slot_bytes = slot_bytes;
    p->pull_blocks = pull_blocks;
    p->pull_bytes = pull_bytes;
    for (int i = 0; i < world; ++i) {
      p->push[i] = static_cast<uint8_t*>(push[i]);
      p->pull[i] = static_cast<uint8_t*>(pull[i]);
      p->sems[i] = static_cast<Semaphore*>(sems[i]);
    }
    *out = p;
  });
}

void peers_sglang_destroy(void* h) { delete static_cast<Planes*>(h); }

// dtype: 0 f32, 1 f16, 2 bf16; algo: 0 1shot_push, 1 2shot_push, 2 1shot_pull, 3 2shot_pull.
// `graph_row`: a device row of `world` pointers (rank r's copy of `input` at r), filled before
// the captured call replays, or null for an eager call. `threads`: SGLang's
// `choose_block_size` for the call (allreduce-peers restates it).
int peers_sglang_all_reduce(void* h, void* stream, int dtype, int algo, const void* input,
                            void* output, int64_t nbytes, void* const* graph_row, int threads,
                            char* err, size_t len) {
  return guarded(err, len, [&] {
    const auto& p = *static_cast<const Planes*>(h);
    auto s = static_cast<cudaStream_t>(stream);
    const auto t = static_cast<uint32_t>(threads);
    switch (dtype) {
      case 0: return run_world<float>(p, s, algo, input, output, nbytes, graph_row, t);
      case 1: return run_world<sglang::fp16_t>(p, s, algo, input, output, nbytes, graph_row, t);
      case 2: return run_world<sglang::bf16_t>(p, s, algo, input, output, nbytes, graph_row, t);
      default: throw std::runtime_error("dtype " + std::to_string(dtype) + ": want 0, 1 or 2");
    }
  });
}

}  // extern "C"
