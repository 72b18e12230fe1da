"""One tree build at a budget, a few times: the launch Nsight Compute profiles (profiling/debug/ncu_tree.sh).

python profiling/debug/tree_one.py --budget 64 --depth 15
"""

import argparse

import torch

from k26.spec.tree import build_ddtree_from_topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(1, a.depth, 163840, device="cuda") * 3, dim=-1)
    top_lp, top_tok = lp.topk(a.budget, dim=-1)
    for _ in range(a.calls):
        build_ddtree_from_topk(top_lp, top_tok, a.budget)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
