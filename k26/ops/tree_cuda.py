"""Front door of the DDTree builder kernel (csrc/ddtree_build.cu): one thread block per tree."""

from __future__ import annotations

import torch

from .build import available, library


def build_ddtree_cuda(lp: torch.Tensor, tok: torch.Tensor, budget: int):
    """(tokens, parents, depths, valid, words, scores) from top-K [B, L, K]; None without the library."""
    if not available():
        return None
    B, L, K = lp.shape
    N = 1 + budget
    dev = lp.device
    lib = library()
    lp32, tok64 = lp.float().contiguous(), tok.to(torch.int64).contiguous()
    out_tok = torch.empty(B, N, dtype=torch.int64, device=dev)
    out_par, out_dep = torch.empty_like(out_tok), torch.empty_like(out_tok)
    out_valid = torch.empty(B, N, dtype=torch.bool, device=dev)
    words = torch.empty(B, N, (N + 63) // 64, dtype=torch.int64, device=dev)
    scores = torch.empty(B, N, dtype=torch.float64, device=dev)
    scratch = torch.empty(lib.k26_ddtree_scratch(B, L, budget), dtype=torch.uint8, device=dev)
    err = lib.k26_ddtree_build(
        lp32.data_ptr(),
        tok64.data_ptr(),
        B,
        L,
        K,
        budget,
        out_tok.data_ptr(),
        out_par.data_ptr(),
        out_dep.data_ptr(),
        out_valid.data_ptr(),
        words.data_ptr(),
        scores.data_ptr(),
        scratch.data_ptr(),
        torch.cuda.current_stream(dev).cuda_stream,
    )
    if err:
        raise RuntimeError(f"ddtree build: CUDA launch failed with error {err}")
    return out_tok, out_par, out_dep, out_valid, words, scores
