"""Corpus and tokenizer training for the embedded default pair."""

from k26.tokenizer import Tokenizer, save_tokenizer
from k26.train import bpe, corpus


def test_corpus_is_pinned_sorted_and_split():
    train, held = corpus.files("train"), corpus.files("eval")
    assert train == sorted(train) and len(train) > 80 and len(held) >= 6
    assert not {p.name for p in train} & {p.name for p in held}


def test_bpe_round_trips_held_out_text_through_the_kimi_tokenizer(tmp_path):
    ranks = bpe.train_bpe(corpus.text("train")[:300_000], 600)
    assert len(ranks) == 600 and all(ranks[bytes([b])] == b for b in range(256))
    save_tokenizer(tmp_path, ranks)
    tok = Tokenizer.from_dir(tmp_path)
    text = corpus.text("eval")[:50_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.0  # merges actually compress code
    assert tok.token_id("<|im_end|>") == 600 + 2


def test_trained_model_exports_to_the_release_layout(tmp_path):
    """A KimiK2 trained in k26 round-trips through the K2.6 checkpoint layout and the normal loader."""
    import torch

    from k26 import LLM
    from k26.config import ModelConfig
    from k26.model import KimiK2
    from k26.tiny import DEFAULT_SIZES, save_checkpoint, text_config
    from k26.train.export import hf_tensors

    first = save_tokenizer(tmp_path, bpe.train_bpe(corpus.text("train")[:100_000], 384))
    model = KimiK2(ModelConfig.from_dict(text_config(DEFAULT_SIZES, first, "none")), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(
                (torch.randn(p.shape, generator=g) * (0.05 if "bias" in n else 1 / p.shape[-1] ** 0.5))
                .to(torch.bfloat16)
                .float()
            )
    model.rope.reset_buffers()
    save_checkpoint(tmp_path, text_config(DEFAULT_SIZES, first, "none"), hf_tensors(model, "none"), shards=2)
    llm = LLM(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    ids = torch.randint(0, 600, (1, 17), generator=g)
    with torch.no_grad():
        want = model.logits(model.forward_train(ids)[0])[0]
    got = llm.score(ids[0].tolist())
    assert ((got - want).norm() / want.norm()).item() < 1e-4
