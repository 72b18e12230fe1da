"""Training the embedded default pair (issue 8): corpus, tokenizer; model training lives in scripts/."""
