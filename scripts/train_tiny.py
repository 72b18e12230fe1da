"""Train the embedded default target: the K2.6 architecture (MLA, sigmoid-routed MoE with correction bias,
shared expert, dense first layer) on the Python standard library, then save it in the exact K2.6 layout
(kimi_k25 config, `language_model.` prefix, int4 pack-quantized experts) with its BPE tokenizer.

    python scripts/train_tiny.py OUT [--minutes 10] [--device cuda] [--hidden 384 --layers 6 --experts 32]

Routing is balanced the auxiliary-loss-free way (DeepSeek-V3): after each step every expert's correction
bias moves by ±gamma towards the mean load. A loss log (train / held-out) is written to OUT/train_log.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from k26.config import ModelConfig
from k26.model import KimiK2
from k26.model.moe import MoE
from k26.tiny import DEFAULT_SIZES, check_out_dir, save_checkpoint, text_config
from k26.tokenizer import Tokenizer, read_ranks, save_tokenizer
from k26.train import bpe, corpus
from k26.train.export import hf_tensors


def batches(ids: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    while True:
        start = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq + 1] for s in start.tolist()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="reuse this directory's tiktoken.model instead of training a new BPE")
    a = ap.parse_args()
    out = Path(a.out)
    heads = max(2, a.hidden // 64)
    sizes = DEFAULT_SIZES | {
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "first_k_dense_replace": 1,
        "num_attention_heads": heads,
        "q_lora_rank": a.hidden // 2,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 4 * a.hidden,
        "moe_intermediate_size": a.hidden // 2 // 32 * 32 or 64,
        "n_routed_experts": a.experts,
        "num_experts_per_tok": a.topk,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 1024,
    }
    try:  # OUT and the exported (int4) config checked before any write or training (vocab: a placeholder)
        check_out_dir(out)
        ModelConfig.from_dict(text_config(sizes, a.vocab, "int4"))
    except ValueError as e:  # (ConfigError too)
        ap.error(str(e))
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)

    t0 = time.time()
    if a.tokenizer:  # the BPE is deterministic for a corpus; retraining it only costs minutes
        first = save_tokenizer(out, read_ranks(Path(a.tokenizer) / "tiktoken.model"))
    else:
        first = save_tokenizer(out, bpe.train_bpe(corpus.text("train"), a.vocab))
    tok = Tokenizer.from_dir(out)
    train_ids = torch.tensor(tok.encode(corpus.text("train")), dtype=torch.long)
    eval_ids = torch.tensor(tok.encode(corpus.text("eval")), dtype=torch.long)
    print(
        f"tokenizer {a.vocab} in {time.time() - t0:.0f}s; "
        f"{len(train_ids)} train / {len(eval_ids)} eval tokens"
    )

    cfg_train = ModelConfig.from_dict(text_config(sizes, first, "none"))
    model = KimiK2(cfg_train, dtype=torch.float32).to(dev)
    for n, p in model.named_parameters():  # init: the loader normally fills these
        if n.endswith("e_score_correction_bias"):
            p.data.zero_()
        elif "norm" in n:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0, 0.02 if "embed" in n else 1 / math.sqrt(p.shape[-1]))
    model.rope.reset_buffers()
    model.requires_grad_(True)
    for n, p in model.named_parameters():
        if n.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)
    data = batches(train_ids, a.seq, a.batch, gen)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    loads: dict[int, torch.Tensor] = {}
    for i, m in enumerate(moes):  # count tokens per expert for the bias update
        m.gate.register_forward_hook(
            lambda mod, inp, outp, i=i: loads.__setitem__(
                i, torch.bincount(outp[1].flatten(), minlength=mod.cfg.n_routed_experts).float()
            )
        )
    # bf16 autocast on the GPU (fp32 master weights); the LR follows warm-up then cosine over the wall clock.
    amp = torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda")
    log, step, start = [], 0, time.time()
    deadline = start + a.minutes * 60
    while time.time() < deadline:
        x = next(data).to(dev)
        frac = (time.time() - start) / (deadline - start)
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        with amp:
            h, _ = model.forward_train(x[:, :-1])
            loss = F.cross_entropy(model.logits(h).flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            for i, m in enumerate(moes):
                load = loads[i]
                m.gate.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        if step % 50 == 0:
            with torch.no_grad():
                e = eval_ids[: (len(eval_ids) // (a.seq + 1)) * (a.seq + 1)].view(-1, a.seq + 1)[:32].to(dev)
                with amp:
                    he, _ = model.forward_train(e[:, :-1])
                    ev = F.cross_entropy(model.logits(he).flatten(0, 1).float(), e[:, 1:].flatten()).item()
            log.append((step, round(time.time() - t0), loss.item(), ev))
            print(f"step {step} t={log[-1][1]}s train {loss.item():.3f} eval {ev:.3f}", flush=True)
        step += 1
    text = text_config(sizes, first, "int4")
    save_checkpoint(out, text, hf_tensors(model, "int4"), flavour="k25", shards=2)
    shown = {k: sizes[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts")}
    (out / "train_log.md").write_text(
        f"# train_tiny — {time.strftime('%Y-%m-%d')}\n\n- device: {dev}; {step} steps in {a.minutes} min; "
        f"config: {json.dumps(shown)}\n\n"
        "| step | s | train loss | held-out loss |\n|---|---|---|---|\n"
        + "\n".join(f"| {s} | {t} | {tr:.3f} | {ev:.3f} |" for s, t, tr, ev in log)
        + "\n"
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
