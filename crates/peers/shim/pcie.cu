// A C face for FlashInfer's PCIe IPC all-reduce (flashinfer/comm/pcie_ipc_all_reduce.cuh,
// namespace flashinfer::comm::pcie_ipc), so the bench can time it beside ours. The header is
// fetched by scripts/peers/fetch.sh and used unmodified; this file keeps what FlashInfer's
// binding (csrc pcie_ipc_all_reduce.cu: pcie_ipc_workspace_size, pcie_ipc_init,
// pcie_ipc_all_reduce) keeps per rank, and refuses what that binding refuses. The launch
// parameters are chosen by the caller (crates/peers: FlashInfer's untuned policy), as the
// binding takes them from its Python layer.
//
// Every function returns 0, or -1 with a message in `err`: no C++ exception crosses into Rust.

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flashinfer/comm/pcie_ipc_all_reduce.cuh"
#include "guard.h"

namespace {

namespace fi = flashinfer::comm::pcie_ipc;

using peers_shim::guarded;

// What FlashInfer's handle holds for the SM kernels (its copy-engine resources are for the
// copy-engine variants, which its untuned policy never picks).
struct Handle {
  fi::PeerViews views;
  fi::WorkspaceLayout layout;
  int rank;
  int world;
  int max_blocks;
  int64_t max_numel;
  int elem;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

}  // namespace

extern "C" {

// Bytes of one rank's slab (FlashInfer's pcie_ipc_workspace_size without the SM120-only memop
// flags, which the H100/H200 path does not allocate).
int peers_pcie_workspace_bytes(int world, int64_t max_numel, int elem, int max_blocks,
                               int64_t* out, char* err, size_t len) {
  return guarded(err, len, [&] {
    require(world == 2 || world == 4 || world == 8, "world size 2, 4 or 8");
    require(max_numel > 0 && max_blocks > 0, "max_numel and max_blocks must be positive");
    require(elem == 2, "2-byte elements only (bf16, f16), as FlashInfer's binding");
    *out = fi::workspace_size(world, max_numel, elem, max_blocks);
  });
}

// `slabs[r]`: rank r's zeroed slab of peers_pcie_workspace_bytes (FlashInfer's pcie_ipc_init
// zeroes its own; the caller allocates them zeroed and starts no call until every rank's is).
// Ranks of one process share an address space, so these are what the IPC exchange would give.
int peers_pcie_create(void** slabs, int world, int rank, int64_t max_numel, int elem,
                      int max_blocks, void** out, char* err, size_t len) {
  return guarded(err, len, [&] {
    require(world == 2 || world == 4 || world == 8, "world size 2, 4 or 8");
    require(rank >= 0 && rank < world, "rank out of range");
    require(elem == 2, "2-byte elements only (bf16, f16), as FlashInfer's binding");
    require(max_blocks > 0, "max_blocks must be positive");
    require(max_numel > 0 && max_numel % (16 / elem) == 0,
            "max_numel must be a positive multiple of the 16-byte pack");
    int64_t ptrs[fi::kMaxWorldSize] = {};
    for (int i = 0; i < world; i++) {
      require(slabs[i] != nullptr, "a null slab");
      ptrs[i] = reinterpret_cast<int64_t>(slabs[i]);
    }
    auto* h = new Handle();
    h->layout = fi::compute_workspace_layout(world, max_numel, elem, max_blocks);
    h->views = fi::make_peer_views(ptrs, world, rank, h->layout);
    h->rank = rank;
    h->world = world;
    h->max_blocks = max_blocks;
    h->max_numel = max_numel;
    h->elem = elem;
    *out = h;
  });
}

void peers_pcie_destroy(void* h) { delete static_cast<Handle*>(h); }

// dtype: 1 f16, 2 bf16 (FlashInfer instantiates no other). `variant`: fi::Variant's value.
// The checks are those of FlashInfer's pcie_ipc_all_reduce: a launch they would refuse must
// fail here, not hang the peers. Programmatic dependent launch is off: the binding refuses it.
int peers_pcie_all_reduce(void* handle, void* stream, int dtype, const void* input, void* output,
                          int64_t numel, int blocks, int threads, int variant, char* err,
                          size_t len) {
  return guarded(err, len, [&] {
    auto* h = static_cast<Handle*>(handle);
    const int64_t pack = 16 / h->elem;
    require(numel > 0 && numel % pack == 0, "numel must be a whole number of 16-byte packs");
    require(static_cast<size_t>(numel) * h->elem <= h->layout.max_payload_bytes,
            "payload exceeds the workspace capacity");
    require(blocks > 0 && blocks <= h->max_blocks, "blocks must be in (0, max_blocks]");
    require(threads >= h->world && threads <= 1024, "threads must be in [world, 1024]");
    require(variant >= 0 && variant <= static_cast<int>(fi::Variant::kFlatStaged),
            "only the SM variants (0-3) run here");
    const auto v = static_cast<fi::Variant>(variant);
    require(!(h->world == 2 && v != fi::Variant::kUnstaged && v != fi::Variant::kStaged),
            "world size 2 runs kUnstaged or kStaged only");
    require(!(v == fi::Variant::kFlatStaged && h->world != 8), "kFlatStaged is world size 8 only");
    require(!(h->world == 8 && v == fi::Variant::kStaged && blocks % 4 != 0),
            "the world-8 staged kernel needs blocks divisible by 4");
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t e;
    switch (dtype) {
      case 1:
        e = fi::all_reduce<half>(static_cast<const half*>(input), static_cast<half*>(output), numel,
                                 h->views, h->rank, h->world, h->max_blocks, h->max_numel, blocks,
                                 threads, v, false, s);
        break;
      case 2:
        e = fi::all_reduce<nv_bfloat16>(static_cast<const nv_bfloat16*>(input),
                                        static_cast<nv_bfloat16*>(output), numel, h->views,
                                        h->rank, h->world, h->max_blocks, h->max_numel, blocks,
                                        threads, v, false, s);
        break;
      default:
        throw std::runtime_error("dtype " + std::to_string(dtype) + ": bf16 and f16 only");
    }
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
  });
}

}  // extern "C"
