// A C face for vLLM's custom all-reduce (`vllm::CustomAllreduce`, as FlashInfer ships it in
// flashinfer/comm/vllm_custom_all_reduce.cuh), so the bench can time it beside ours. The
// header is fetched by scripts/peers/fetch.sh and used unmodified; this file only catches its
// exceptions and adds what vLLM's Python layer does around it.
//
// Every function returns 0, or -1 with a message in `err`: no C++ exception crosses into Rust.

#include <cstdio>
#include <cstring>
#include <exception>

#include "flashinfer/comm/vllm_custom_all_reduce.cuh"
#include "guard.h"

using peers_shim::guarded;
using peers_shim::set_error;

extern "C" {

// The signal block at the head of each rank's meta buffer; the 2-stage kernel's scratch
// follows it (vLLM allocates meta_size() + max_size bytes per rank, zeroed).
size_t peers_vllm_signal_bytes() { return sizeof(vllm::Signal); }

int peers_vllm_max_blocks() { return vllm::kMaxBlocks; }

// `signals[r]`: rank r's zeroed meta buffer; `rank_data`: device memory for the registered
// pointer tables (vLLM gives 8 MiB).
int peers_vllm_create(void** signals, void* rank_data, size_t rank_data_bytes, int rank, int world,
                      int full_nvlink, void** out, char* err, size_t len) {
  return guarded(err, len, [&] {
    *out = new vllm::CustomAllreduce(reinterpret_cast<vllm::Signal**>(signals), rank_data,
                                     rank_data_bytes, rank, world, full_nvlink != 0);
  });
}

void peers_vllm_destroy(void* h) {
  try {
    delete static_cast<vllm::CustomAllreduce*>(h);
  } catch (...) {
  }
}

// Registers every rank's copy of one input buffer (`ptrs[r]` is rank r's), as vLLM's
// `register_buffer` does with the pointers its ranks exchanged over IPC.
int peers_vllm_register(void* h, void** ptrs, char* err, size_t len) {
  return guarded(err, len, [&] { static_cast<vllm::CustomAllreduce*>(h)->register_buffer(ptrs); });
}

// After a CUDA-graph capture: the inputs the captured calls used, in call order, get their
// peers' pointers. vLLM exchanges IPC handles for this (`register_graph_buffers`); ranks of
// one process already share an address space, so the tables are written directly, in the
// order and format vLLM writes them. `ptrs[i * world + r]`: rank r's copy of the i-th input.
int peers_vllm_register_graph(void* h, void** ptrs, int buffers, char* err, size_t len) {
  return guarded(err, len, [&] {
    auto* c = static_cast<vllm::CustomAllreduce*>(h);
    if (buffers != static_cast<int>(c->graph_unreg_buffers_.size()))
      throw std::runtime_error("the capture used " + std::to_string(c->graph_unreg_buffers_.size()) +
                               " inputs, " + std::to_string(buffers) + " given");
    c->check_rank_data_capacity(buffers);
    std::vector<vllm::RankData> data(buffers);
    for (int i = 0; i < buffers; i++) {
      for (int r = 0; r < c->world_size_; r++) data[i].ptrs[r] = ptrs[i * c->world_size_ + r];
      if (data[i].ptrs[c->rank_] != c->graph_unreg_buffers_[i])
        throw std::runtime_error("graph input " + std::to_string(i) + " is not the captured one");
    }
    CHECK_CUDA_SUCCESS(cudaMemcpy(c->d_rank_data_base_, data.data(),
                                  sizeof(vllm::RankData) * buffers, cudaMemcpyHostToDevice));
    c->d_rank_data_base_ += buffers;
    c->graph_unreg_buffers_.clear();
  });
}

// dtype: 0 f32, 1 f16, 2 bf16. `n` elements; `input` registered (or captured). vLLM's own
// switch between its one-stage and two-stage kernels runs inside.
int peers_vllm_all_reduce(void* h, void* stream, int dtype, void* input, void* output, int n,
                          int block_limit, int threads, char* err, size_t len) {
  return guarded(err, len, [&] {
    auto* c = static_cast<vllm::CustomAllreduce*>(h);
    auto s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
      case 0:
        c->allreduce<float>(s, static_cast<float*>(input), static_cast<float*>(output), n,
                            block_limit, threads);
        break;
      case 1:
        c->allreduce<half>(s, static_cast<half*>(input), static_cast<half*>(output), n,
                           block_limit, threads);
        break;
      case 2:
        c->allreduce<nv_bfloat16>(s, static_cast<nv_bfloat16*>(input),
                                  static_cast<nv_bfloat16*>(output), n, block_limit, threads);
        break;
      default:
        throw std::runtime_error("dtype " + std::to_string(dtype) + ": want 0, 1 or 2");
    }
    CHECK_CUDA_SUCCESS(cudaGetLastError());
  });
}

// vLLM's eager call on an unregistered input (`all_reduce(..., reg_buffer, ...)` in its
// csrc): copy the input into this rank's registered buffer `staging`, then reduce from there.
int peers_vllm_all_reduce_staged(void* h, void* stream, int dtype, const void* input,
                                 void* staging, void* output, int n, int block_limit, int threads,
                                 char* err, size_t len) {
  static const size_t elem[] = {4, 2, 2};
  if (dtype < 0 || dtype > 2) {
    set_error(err, len, "dtype: want 0, 1 or 2");
    return -1;
  }
  cudaError_t e = cudaMemcpyAsync(staging, input, elem[dtype] * static_cast<size_t>(n),
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    set_error(err, len, cudaGetErrorString(e));
    return -1;
  }
  return peers_vllm_all_reduce(h, stream, dtype, staging, output, n, block_limit, threads, err,
                               len);
}

}  // extern "C"
