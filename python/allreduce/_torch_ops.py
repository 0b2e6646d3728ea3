"""The all-reduce as ``torch.library`` custom ops, each with a fake (meta) implementation, so
that ``torch.compile`` traces it as one node and ``torch.cuda.graph`` captures its kernels:

    torch.ops.allreduce.all_reduce(x, key, precision="exact", strategy="auto") -> Tensor
    torch.ops.allreduce.all_reduce_inplace(x, key, precision="exact", strategy="auto")
    torch.ops.allreduce.all_reduce_out(x, out, key, precision="exact", strategy="auto")
    torch.ops.allreduce.all_reduce_fused(x, key, ws_key, residual_in, residual_out, norm_out,
        quant_out, scale_out, rms_gamma, rms_eps, pattern, allreduce_out, use_oneshot,
        static_scale, weight_bias)

``key`` is ``Communicator.key`` (``ws_key`` ``FusedWorkspace.key``): custom ops take tensors
and scalars only, so a rank is named by an int and looked up in the registry of open
communicators. Each op runs
``Communicator.all_reduce``'s checks and call on torch's current stream; its refusals raise
the same ``allreduce.Error`` subclasses and reach the peers the same way.

Importing this module imports torch and registers the ops (once per process).
``allreduce`` imports it when torch is already loaded, ``Communicator.all_reduce`` on the
first torch tensor, and :func:`allreduce.torch_ops` on request.
"""

from __future__ import annotations

import torch

from typing import Optional

from . import _comm, _fused

# The in-place op mutates `x` and the out op mutates `out`; declared, so functionalization
# under torch.compile orders them against the tensors' other readers and writers. A separate
# in-place op rather than `all_reduce_out(x, x)`: a mutated argument aliasing another is
# something functionalization does not promise to handle.


@torch.library.custom_op("allreduce::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, key: int, precision: str = "exact",
               strategy: str = "auto") -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _comm.lookup(key)._all_reduce(x, out, precision, strategy, None)
    return out


@all_reduce.register_fake
def _(x, key, precision="exact", strategy="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("allreduce::all_reduce_inplace", mutates_args=("x",))
def all_reduce_inplace(x: torch.Tensor, key: int, precision: str = "exact",
                       strategy: str = "auto") -> None:
    _comm.lookup(key)._all_reduce(x, None, precision, strategy, None)


@all_reduce_inplace.register_fake
def _(x, key, precision="exact", strategy="auto"):
    return None


@torch.library.custom_op("allreduce::all_reduce_out", mutates_args=("out",))
def all_reduce_out(x: torch.Tensor, out: torch.Tensor, key: int, precision: str = "exact",
                   strategy: str = "auto") -> None:
    _comm.lookup(key)._all_reduce(x, out, precision, strategy, None)


@all_reduce_out.register_fake
def _(x, out, key, precision="exact", strategy="auto"):
    return None


# The fused call writes only the outputs it is given, and `x` only for pattern "allreduce"
# without `allreduce_out`; every one that may be written is declared mutated. `residual_out`
# may be `residual_in` in eager calls; under torch.compile pass distinct tensors (a mutated
# argument aliasing another is not something functionalization promises to handle).
@torch.library.custom_op(
    "allreduce::all_reduce_fused",
    mutates_args=("x", "residual_out", "norm_out", "quant_out", "scale_out", "allreduce_out"))
def all_reduce_fused(x: torch.Tensor, key: int, ws_key: int,
                     residual_in: Optional[torch.Tensor], residual_out: Optional[torch.Tensor],
                     norm_out: Optional[torch.Tensor], quant_out: Optional[torch.Tensor],
                     scale_out: Optional[torch.Tensor], rms_gamma: Optional[torch.Tensor],
                     rms_eps: float, pattern: Optional[str],
                     allreduce_out: Optional[torch.Tensor], use_oneshot: Optional[bool],
                     static_scale: Optional[torch.Tensor], weight_bias: float) -> None:
    _fused.all_reduce_fused(_comm.lookup(key), _fused.lookup_workspace(ws_key), x, residual_in,
                            residual_out, norm_out, quant_out, scale_out, rms_gamma, rms_eps,
                            pattern, allreduce_out, use_oneshot, static_scale, None,
                            weight_bias)


@all_reduce_fused.register_fake
def _(x, key, ws_key, residual_in, residual_out, norm_out, quant_out, scale_out, rms_gamma,
      rms_eps, pattern, allreduce_out, use_oneshot, static_scale, weight_bias):
    return None


def call_fused(comm: "_comm.Communicator", ws: "_fused.FusedWorkspace", x: torch.Tensor,
               residual_in, residual_out, norm_out, quant_out, scale_out, rms_gamma,
               rms_eps: float, pattern, allreduce_out, use_oneshot, static_scale,
               weight_bias: float) -> None:
    """``Communicator.all_reduce_fused`` for torch tensors, through the op."""
    torch.ops.allreduce.all_reduce_fused(x, comm.key, ws.key, residual_in, residual_out,
                                         norm_out, quant_out, scale_out, rms_gamma,
                                         float(rms_eps), pattern, allreduce_out, use_oneshot,
                                         static_scale, float(weight_bias))


def call(comm: "_comm.Communicator", x: torch.Tensor, out, precision: str,
         strategy: str):
    """``Communicator.all_reduce`` for a torch tensor, through the ops."""
    if out is None:
        torch.ops.allreduce.all_reduce_inplace(x, comm.key, precision, strategy)
        return x
    torch.ops.allreduce.all_reduce_out(x, out, comm.key, precision, strategy)
    return out
