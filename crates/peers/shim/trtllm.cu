// A C face for TensorRT-LLM's all-reduce fusion kernels (Lamport one-shot and two-shot, fused
// with residual + RMSNorm and FP8 output), as FlashInfer ships them in
// flashinfer/comm/trtllm_allreduce_fusion.cuh. The header is fetched by scripts/peers/fetch.sh
// and used unmodified; this file lays out the workspace the way FlashInfer's Python layer
// (`trtllm_create_ipc_workspace_for_all_reduce_fusion`) does, and catches exceptions.
//
// Every function returns 0, or -1 with a message in `err`: no C++ exception crosses into Rust.

#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

// The launcher sizes its grid from the device's SM count (read once, then cached). On virtual
// ranks every rank's grid must co-reside with its peers', so the bench gives TensorRT-LLM the
// same share of the GPU as our kernels get: its launcher reads SMs / ranks instead of all SMs,
// and otherwise picks every launch parameter as its library would.
static int g_sm_share = 0;
static int g_sm_share_launched = 0;

static cudaError_t peers_device_get_attribute(int* value, cudaDeviceAttr attr, int device) {
  cudaError_t e = cudaDeviceGetAttribute(value, attr, device);
  if (e == cudaSuccess && attr == cudaDevAttrMultiProcessorCount && g_sm_share > 0 &&
      g_sm_share < *value)
    *value = g_sm_share;
  return e;
}
#define cudaDeviceGetAttribute peers_device_get_attribute
#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"
#undef cudaDeviceGetAttribute

#include "guard.h"

namespace {

namespace fusion = flashinfer::trtllm_allreduce_fusion;

using peers_shim::guarded;
using peers_shim::set_error;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// The Lamport buffers start (and are cleared back to) negative zero of the element type: the
// kernel treats -0.0 as "not yet written".
__global__ void fill_u16(uint16_t* p, size_t n, uint16_t v) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = v;
}
__global__ void fill_u32(uint32_t* p, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = v;
}

// FlashInfer's `allreduce_fusion_op` only dispatches on (pattern, ranks, accumulation) to
// `allreduce_fusion_kernel_launcher`, which picks the launch; dispatching here to the same
// launcher instantiates only the cases the bench runs (the full table takes minutes to
// compile). Accumulation is f32, TensorRT-LLM's default and what our exact path does.
template <typename T, int NRanks>
cudaError_t by_pattern(const fusion::AllReduceFusionParams<T>& p, bool pdl) {
  using P = fusion::AllReduceFusionPattern;
  // f32 inputs already sum in f32 (the header refuses the flag for them).
  constexpr bool A = !std::is_same_v<T, float>;
  switch (p.pattern) {
    case P::kAllReduce:
      return fusion::allreduce_fusion_kernel_launcher<P::kAllReduce, T, NRanks, A>(p, pdl);
    case P::kARResidualRMSNorm:
      return fusion::allreduce_fusion_kernel_launcher<P::kARResidualRMSNorm, T, NRanks, A>(
          p, pdl);
    case P::kARResidualRMSNormFP8Quant:
      return fusion::allreduce_fusion_kernel_launcher<P::kARResidualRMSNormFP8Quant, T, NRanks,
                                                      A>(p, pdl);
    case P::kARResidualRMSNormDynamicFP8Quant:
      return fusion::allreduce_fusion_kernel_launcher<P::kARResidualRMSNormDynamicFP8Quant, T,
                                                      NRanks, A>(p, pdl);
    default:
      throw std::runtime_error("pattern not instantiated");
  }
}

template <typename T>
void launch(const fusion::AllReduceFusionParams<T>& p, bool pdl) {
  cudaError_t e;
  switch (p.nranks) {
    case 2:
      e = by_pattern<T, 2>(p, pdl);
      break;
    case 4:
      e = by_pattern<T, 4>(p, pdl);
      break;
    case 8:
      e = by_pattern<T, 8>(p, pdl);
      break;
    default:
      throw std::runtime_error("TensorRT-LLM's fusion kernels run 2, 4, 8 (or 16) ranks; " +
                               std::to_string(p.nranks) + " asked");
  }
  check(e, "allreduce_fusion_kernel_launcher");
  check(cudaGetLastError(), "allreduce_fusion launch");
}

}  // namespace

extern "C" {

// Bytes per rank, as FlashInfer sizes them for `max_tokens` x `hidden` of `elem` bytes: the
// two-shot buffer, the two-shot barrier flags, and one of the three Lamport slots.
void peers_trtllm_sizes(int world, int max_tokens, int hidden, int elem, size_t* comm,
                        size_t* flags, size_t* lamport_slot) {
  size_t msg = static_cast<size_t>(max_tokens) * hidden * elem;
  *comm = world * msg;
  *flags = static_cast<size_t>(world) * fusion::details::kBarrierFlagCount * sizeof(int);
  *lamport_slot = world * msg;
}

// Bytes of one rank's flag block (int[5]) and pointer table (3 x world + 1 pointers).
size_t peers_trtllm_flag_bytes() { return 5 * sizeof(int); }
size_t peers_trtllm_table_bytes(int world) { return (3 * static_cast<size_t>(world) + 1) * 8; }

// The SM count the launcher sizes grids by (0: the device's). One value per process: the
// launcher caches the first it reads.
int peers_trtllm_set_sm_share(int sms, char* err, size_t len) {
  if (g_sm_share_launched && sms != g_sm_share) {
    set_error(err, len,
              "TensorRT-LLM's launcher cached its SM count at the first launch: one GPU share "
              "per process");
    return -1;
  }
  g_sm_share = sms;
  return 0;
}

// Rank `rank`'s part of the workspace: `comm[r]`, `barrier[r]`, `lamport[r]` are every rank's
// buffers (sizes from peers_trtllm_sizes; the Lamport one holds three slots); `flag` is this
// rank's int[5] and `table` its pointer table. Fills this rank's buffers on `stream`.
int peers_trtllm_init_rank(int world, int rank, void** comm, void** barrier, void** lamport,
                           void* flag, void* table, size_t comm_bytes, size_t flag_bytes,
                           size_t lamport_slot, int elem, void* stream, char* err, size_t len) {
  return guarded(err, len, [&] {
    if (lamport_slot > static_cast<size_t>(INT32_MAX))
      throw std::runtime_error("a Lamport slot over 2 GiB: the kernel keeps its size in an int");
    auto s = static_cast<cudaStream_t>(stream);
    check(cudaMemsetAsync(comm[rank], 0, comm_bytes, s), "memset comm");
    check(cudaMemsetAsync(barrier[rank], 0, flag_bytes, s), "memset flags");
    size_t bytes = 3 * lamport_slot;
    if (elem == 4)
      fill_u32<<<256, 256, 0, s>>>(static_cast<uint32_t*>(lamport[rank]), bytes / 4, 0x80000000u);
    else
      fill_u16<<<256, 256, 0, s>>>(static_cast<uint16_t*>(lamport[rank]), bytes / 2, 0x8000u);
    check(cudaGetLastError(), "fill lamport");
    // {CTA counter, two-shot flag, Lamport flag, Lamport slot bytes, clear size}
    int flags[5] = {0, 0, 0, static_cast<int>(lamport_slot), 0};
    std::vector<void*> ptrs(3 * world + 1);
    for (int r = 0; r < world; r++) {
      ptrs[r] = comm[r];
      ptrs[world + r] = barrier[r];
      ptrs[2 * world + r] = lamport[r];
    }
    ptrs[3 * world] = flag;
    check(cudaMemcpyAsync(flag, flags, sizeof flags, cudaMemcpyHostToDevice, s), "upload flags");
    check(cudaMemcpyAsync(table, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                          s),
          "upload table");
    check(cudaStreamSynchronize(s), "init");
  });
}

// One fused call. pattern: FlashInfer's AllReduceFusionPattern code (0 all-reduce, 1 +
// residual + RMSNorm, 2 + FP8 with a static scale, 10 + FP8 with per-token scales); dtype: 0
// f32, 1 f16, 2 bf16. `oneshot`: the Lamport one-shot kernel, else the two-shot one.
int peers_trtllm_fusion(void* table, int world, int rank, void* stream, int dtype, int pattern,
                        int tokens, int hidden, void* input, void* residual_in,
                        void* residual_out, void* norm_out, void* quant_out, void* scale_out,
                        void* gamma, float eps, void* scale_factor, int oneshot, int pdl,
                        char* err, size_t len) {
  return guarded(err, len, [&] {
    switch (pattern) {
      case 0:
      case 1:
      case 2:
      case 10:
        break;
      default:
        throw std::runtime_error("pattern " + std::to_string(pattern) + ": want 0, 1, 2 or 10");
    }
    g_sm_share_launched = 1;
    auto fill = [&](auto& p) {
      p.nranks = world;
      p.rank = rank;
      p.size = tokens * hidden;
      p.hidden_dim = hidden;
      p.workspace = static_cast<void**>(table);
      p.allreduce_in = input;
      p.allreduce_out = pattern == 0 ? residual_out : nullptr;
      p.residual_in = residual_in;
      p.residual_out = residual_out;
      p.norm_out = norm_out;
      p.quant_out = quant_out;
      p.scale_out = scale_out;
      p.rms_gamma = gamma;
      p.rms_eps = eps;
      p.scale_factor = static_cast<float*>(scale_factor);
      p.use_oneshot = oneshot != 0;
      p.stream = static_cast<cudaStream_t>(stream);
      p.pattern = static_cast<fusion::AllReduceFusionPattern>(pattern);
    };
    switch (dtype) {
      case 0: {
        fusion::AllReduceFusionParams<float> p;
        fill(p);
        launch(p, pdl != 0);
        break;
      }
      case 1: {
        fusion::AllReduceFusionParams<half> p;
        fill(p);
        launch(p, pdl != 0);
        break;
      }
      case 2: {
        fusion::AllReduceFusionParams<nv_bfloat16> p;
        fill(p);
        launch(p, pdl != 0);
        break;
      }
      default:
        throw std::runtime_error("dtype " + std::to_string(dtype) + ": want 0, 1 or 2");
    }
  });
}

}  // extern "C"
