"""Corpus and tokenizer training for the embedded default pair."""

from k26.tokenizer import Tokenizer
from k26.train import bpe, corpus


def test_corpus_is_pinned_sorted_and_split():
    train, held = corpus.files("train"), corpus.files("eval")
    assert train == sorted(train) and len(train) > 80 and len(held) >= 6
    assert not {p.name for p in train} & {p.name for p in held}


def test_bpe_round_trips_held_out_text_through_the_kimi_tokenizer(tmp_path):
    ranks = bpe.train_bpe(corpus.text("train")[:300_000], 600)
    assert len(ranks) == 600 and all(ranks[bytes([b])] == b for b in range(256))
    bpe.save_tokenizer(tmp_path, ranks)
    tok = Tokenizer.from_dir(tmp_path)
    text = corpus.text("eval")[:50_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.0  # merges actually compress code
    assert tok.token_id("<|im_end|>") == 600 + 2
