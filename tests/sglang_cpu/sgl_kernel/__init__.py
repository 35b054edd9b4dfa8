"""A stand-in for sglang's kernel package on CPU, for the tests only (never imported by the trainer).

PyPI has no CPU build of sgl_kernel, yet with SGLANG_USE_CPU_ENGINE=1 sglang 0.5.23 imports two CPU ops from
it at start-up; every other layer takes its torch-native path when the AMX kernels are absent. These two are
written here in plain torch from what their call sites expect; any other op it is asked for raises when called,
so sglang can never take a silently wrong path through it. tests/test_servers.py puts tests/sglang_cpu on the
server's PYTHONPATH.
"""
import ctypes

import torch

# Bound (not called) at import by sglang/srt/models/qwen3_5.py on any CPU, which the Qwen-VL image processor imports:
# declared without a kernel, so the import succeeds and a call raises. Not convert_weight_packed: with it sglang
# would take its AMX paths (cpu_has_amx_support), whose ops this stand-in does not have.
_LIB = torch.library.Library("sgl_kernel", "DEF")
for _name in ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
              "fused_qkvzba_split_reshape_cat_contiguous_cpu"):
    _LIB.define(f"{_name}(Tensor x) -> Tensor")


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Row i of the batch: req_to_token[req_pool_indices[i], start[i]:end[i]] = its slice of out_cache_loc,
    the slices laid end to end in batch order (sglang/srt/mem_cache/allocation.py, the Triton kernel)."""
    assert req_to_token.shape[1] == pool_len
    offset = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[offset:offset + e - s].to(req_to_token.dtype)
        offset += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every KV buffer (data_ptrs: (n_buffers,) uint64 addresses; strides: bytes per token slot), copy the
    slots src_loc to tgt_loc (sglang/kernels/ops/kvcache/cache_move.py). Only addresses are given, so the
    bytes move with ctypes; all sources are read before any target is written (the sets may overlap)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def __getattr__(name):
    """Other CPU ops sglang imports at start-up for paths these tests never take (speculative decoding, ...):
    importable, but calling one raises."""
    if name.startswith("__"):  # module protocol probes (__version__, ...): the ordinary answer
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the CPU stand-in in tests/sglang_cpu provides only "
                                  "assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu")
    return missing
