"""The public API: LLM.score / LLM.generate / SamplingParams / the CLI, and every bad input."""

import re

import pytest
import torch

import k26
from k26 import LLM, SamplingParams
from k26.__main__ import main


@pytest.fixture(scope="module")
def llm(tiny_k25):
    return LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_model_len=64, max_batch=2)


def test_greedy_generate_follows_score_argmax(llm):
    prompt = [5, 17, 300, 42, 9]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[]))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    seq = list(prompt)
    for t in out.token_ids:
        assert t == int(llm.score(seq)[-1].argmax())
        seq.append(t)


def test_batch_of_prompts_equals_one_by_one(llm):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], "hello world", [40, 41]]  # 4 prompts > max_batch 2
    sp = SamplingParams(max_tokens=5, stop_token_ids=[])
    together = llm.generate(prompts, sp)
    alone = [llm.generate(p, sp)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert together[2].prompt_token_ids == llm.tokenizer.encode("hello world")


def test_stop_token_ends_generation(llm):
    prompt = [5, 17, 300, 42, 9]
    first = llm.generate(prompt, SamplingParams(max_tokens=3, stop_token_ids=[]))[0].token_ids
    out = llm.generate(prompt, SamplingParams(max_tokens=10, stop_token_ids=[first[1]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == first[:1]


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=7, stop_token_ids=[])
    a, b = llm.generate([3, 4, 5], sp)[0], llm.generate([3, 4, 5], sp)[0]
    assert a.token_ids == b.token_ids


def test_seeds_differing_above_32_bits_sample_apart_on_cpu(llm):
    """A CPU generator keeps a seed's low 32 bits: seeds 7 and 7 + 2**32 drew the same tokens; and -1 must
    not fold onto 0 (n = 2 with seed -1 samples seeds -1 and 0: equal choices under a plain xor of halves)."""
    sp = lambda seed: SamplingParams(temperature=1.0, max_tokens=12, seed=seed, stop_token_ids=[])
    for a, b in ((7, 7 + 2**32), (-1, 0), (-2, 1)):
        first, second = (llm.generate([3, 4, 5], sp(s))[0].token_ids for s in (a, b))
        assert first != second, (a, b)
    high = llm.generate([3, 4, 5], sp(7 + 2**32))[0].token_ids
    assert llm.generate([3, 4, 5], sp(7 + 2**32))[0].token_ids == high  # still seeded


def test_context_end_finishes_with_length(llm):
    out = llm.generate(list(range(1, 60)), SamplingParams(max_tokens=50, stop_token_ids=[]))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 64


def test_max_tokens_zero(llm):
    out = llm.generate([1, 2], SamplingParams(max_tokens=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"


def test_top_k_one_is_greedy(llm):
    g = llm.generate([9, 9, 9], SamplingParams(max_tokens=4, stop_token_ids=[]))[0].token_ids
    s = llm.generate(
        [9, 9, 9], SamplingParams(temperature=0.7, top_k=1, max_tokens=4, seed=1, stop_token_ids=[])
    )[0]
    assert s.token_ids == g


@pytest.mark.parametrize(
    "prompt,needle",
    [
        (list(range(64)), "prompt 0 has 64 tokens; the context holds 64"),
        ([1, 2, 640], "token id 640 at position 2 is outside the vocabulary [0, 640)"),
        ([1, -3], "token id -3 at position 1"),
        ([], "prompts is empty"),
        ([[]], "prompt 0 is empty"),
    ],
)
def test_bad_prompts(llm, prompt, needle):
    with pytest.raises(ValueError) as e:
        llm.generate(prompt)
    assert needle in str(e.value)


def test_bad_prompt_type(llm):
    with pytest.raises(TypeError, match="prompt 0 is a dict"):
        llm.generate([{"text": "x"}])


def test_score_checks_ids(llm):
    with pytest.raises(ValueError, match="token_ids: token id 10000"):
        llm.score([1, 10000])
    # (found in an audit: a set was scored in its own order, a dict as its keys)
    for ids in ({3, 1, 2}, {1: 2}):
        with pytest.raises(TypeError, match=f"token_ids is a {type(ids).__name__}; expected a list"):
            llm.score(ids)


@pytest.mark.parametrize("wait", ["x", -5, float("nan"), float("inf"), 1e12, True])
def test_a_bad_close_wait_is_named_and_leaves_the_llm_open(llm, wait):
    # (found in an audit: a raw TypeError / OverflowError after the LLM was marked closed, nothing torn down)
    with pytest.raises(ValueError, match=r"close\(wait="):
        llm.close(wait=wait)
    assert llm.score([1, 2]).shape[0] == 2


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_tokens": -1}, "max_tokens=-1"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -2}, "top_k=-2"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed="),  # torch.Generator refuses it: named here, not inside the engine
        ({"seed": True}, "seed=True"),
        ({"temperature": float("inf")}, "temperature=inf"),  # (sampled uniformly)
        ({"temperature": True}, "temperature=True"),
        ({"top_p": True}, "top_p=True"),
        ({"stop_token_ids": 5}, "stop_token_ids=5: must be None or a list"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop": 5}, "stop=5: must be a string or a list"),
    ],
)
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_bad_constructor_args(tiny_k25):
    with pytest.raises(ValueError, match="tp=0"):
        LLM(tiny_k25, tp=0)
    with pytest.raises(ValueError, match="max_model_len=5000"):
        LLM(tiny_k25, device="cpu", max_model_len=5000, progress=False)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_batch": 2.5}, "max_batch=2.5"),
        ({"max_batch": "8"}, "max_batch='8'"),
        ({"max_model_len": 512.5}, "max_model_len=512.5"),
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"tp": True}, "tp=True"),
        ({"buckets": [(1,)]}, r"bucket \(1,\)"),
        ({"buckets": [(99, 4)]}, "exceeds max_batch"),
        ({"drafter": "/nonexistent-drafter"}, "nonexistent-drafter"),
        ({"cache_dir": 5}, "cache_dir=5"),
        ({"cache_dir": __file__}, "exists and is not a directory"),  # (it warned after the load)
        ({"cache_dir": __file__ + "/sub"}, "cannot be created"),
    ],
)
def test_bad_constructor_args_are_named_before_any_weight_is_read(tiny_k25, monkeypatch, kwargs, needle):
    import k26.engine

    def no_load(*a, **k):
        raise AssertionError("the target's weights were read before the arguments were checked")

    monkeypatch.setattr(k26.engine, "load_model", no_load)
    with pytest.raises((ValueError, TypeError), match=needle):
        LLM(tiny_k25, device="cpu", progress=False, **kwargs)
    with pytest.raises(TypeError, match="model_path=123"):
        LLM(123, device="cpu", progress=False)


def test_cli_output_files_are_checked_before_running(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["bench", "--out", "/proc/k26-bench.md", "--device", "cpu"]) == 2
    assert "cannot write in /proc" in capsys.readouterr().err


def test_cli_generate_prints_text(tiny_k25, capsys):
    assert (
        main(["generate", "--model", str(tiny_k25), "--prompt", "hi", "--max-tokens", "5", "--device", "cpu"])
        == 0
    )
    captured = capsys.readouterr()
    n = int(re.search(r"\[k26\] (\d+) tokens", captured.err).group(1))
    assert 1 <= n <= 5 and ("finish_reason=stop" in captured.err or n == 5)
    # the prompt echoed, then the generated text (the tiny pair's tokens are never all empty strings)
    assert captured.out.startswith("hi") and len(captured.out.rstrip("\n")) > len("hi")


def test_cli_reports_bad_input(tiny_k25, capsys):
    assert (
        main(
            ["generate", "--model", str(tiny_k25), "--prompt", "hi", "--max-tokens", "-1", "--device", "cpu"]
        )
        == 2
    )
    assert "--max-tokens -1" in capsys.readouterr().err


def test_every_name_the_readme_uses_is_exported():
    """`k26.X(` in the README's examples names a class in k26's `__all__` (a renamed or dropped export
    fails here, not in a user's script), and every name in `__all__` resolves."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    used = set(re.findall(r"\bk26\.([A-Z]\w+)\(", readme))
    assert {"LLM", "SamplingParams", "SpecConfig"} <= used
    assert used <= set(k26.__all__), used - set(k26.__all__)
    assert all(isinstance(getattr(k26, n), type) for n in k26.__all__)


def test_stream_yields_the_generated_text(llm):
    sp = SamplingParams(max_tokens=12, stop_token_ids=[])
    pieces = list(llm.stream([5, 17, 300], sp))
    full = llm.generate([[5, 17, 300]], sp)[0]
    assert "".join(pieces) == full.text and len(pieces) >= 1


def test_stop_string_cuts_the_text(llm):
    sp = SamplingParams(max_tokens=20, stop_token_ids=[])
    full = llm.generate([[8, 9, 10]], sp)[0]
    stop = full.text[3:5]
    assert stop
    out = llm.generate([[8, 9, 10]], SamplingParams(max_tokens=20, stop_token_ids=[], stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]


def test_stop_string_at_the_start_leaves_empty_text(llm):
    """A stop string matching the first generated characters: the answer is empty, whole or streamed."""
    sp = SamplingParams(max_tokens=20, stop_token_ids=[])
    full = llm.generate([[8, 9, 10]], sp)[0]
    first = len(llm.tokenizer.decode(full.token_ids[:1]))
    # within the first token, and reaching into the second: the stream holds back what may begin the stop
    for stop in (full.text[:2], full.text[: first + 2]):
        assert stop.strip()
        cut = SamplingParams(max_tokens=20, stop_token_ids=[], stop=[stop])
        out = llm.generate([[8, 9, 10]], cut)[0]
        assert out.finish_reason == "stop" and out.text == ""
        assert "".join(llm.stream([8, 9, 10], cut)) == ""


def test_bad_stop_strings():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


def test_bytes_prompt_is_a_type_error_with_the_fix(llm):
    with pytest.raises(TypeError, match=r"prompt 0 is bytes; .*data.decode\('utf-8'\)"):
        llm.generate(b"def f(x):")
    with pytest.raises(TypeError, match="prompt 1 is bytearray"):
        llm.generate(["ok", bytearray(b"x")])


def test_score_of_text_is_a_type_error_with_the_fix(llm):
    with pytest.raises(TypeError, match=r"token_ids is a str; .*llm.tokenizer.encode\(text\)"):
        llm.score("hello")
    with pytest.raises(TypeError, match="token id 1.5 at position 1 is a float"):
        llm.score([1, 1.5])


def test_integer_tensor_prompts_are_token_ids(llm):
    ids = [5, 17, 300]
    assert torch.equal(llm.score(torch.tensor(ids)), llm.score(ids))
    sp = SamplingParams(max_tokens=3, stop_token_ids=[])
    assert llm.generate(torch.tensor(ids), sp)[0].token_ids == llm.generate(ids, sp)[0].token_ids
    with pytest.raises(TypeError, match="1-d integer tensor"):
        llm.score(torch.ones(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_up_front(tiny_k25):
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
        LLM(tiny_k25, device="cuda", progress=False)


def test_info_names_the_directory_of_a_config_file(tiny_k25, capsys):
    assert main(["info", "--model", str(tiny_k25 / "config.json")]) == 2
    assert f"is a file; pass the checkpoint directory that holds it: {tiny_k25}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is a file; pass the directory that holds it"):
        LLM(tiny_k25 / "config.json", device="cpu", progress=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"k26 {k26.__version__}"


def test_info_refuses_startup_flags_without_startup(tiny_k25, capsys):
    """--drafter / --cache-dir / --device only matter to the start-up `info --startup` runs (they were
    ignored)."""
    assert main(["info", "--model", str(tiny_k25), "--drafter", str(tiny_k25)]) == 2
    assert "--drafter goes with --startup" in capsys.readouterr().err
    assert main(["info", "--model", str(tiny_k25), "--device", "cpu"]) == 2
    assert "--device goes with --startup" in capsys.readouterr().err


def test_a_suspended_stream_refuses_other_calls_and_then_goes_on_unharmed(llm):
    sp = SamplingParams(max_tokens=12, stop_token_ids=[])
    full = llm.generate([[5, 17, 300]], sp)[0].text
    llm.open_batch(capacity=1)  # empty: admit and step would write the stream's row
    g = llm.stream([5, 17, 300], sp)
    first = next(g)
    for call in (
        lambda: llm.generate([[8, 9]], sp),
        lambda: llm.score([8, 9]),
        lambda: next(llm.stream([8, 9], sp)),
        lambda: llm.open_batch(),
        lambda: llm.admit([[8, 9]], [sp]),
        lambda: llm.step(),
    ):
        with pytest.raises(RuntimeError, match=r"a stream\(\) of this LLM is still being iterated"):
            call()
    llm.batch = None
    assert first + "".join(g) == full  # its row was not written meanwhile
    g = llm.stream([5, 17, 300], sp)
    next(g)
    g.close()  # a closed stream frees the rows
    assert llm.generate([[5, 17, 300]], sp)[0].text == full


def test_an_open_batch_with_unfinished_rows_refuses_calls_that_write_rows(llm):
    sp = SamplingParams(max_tokens=6, stop_token_ids=[])
    alone = llm.generate([[5, 17, 300]], sp)[0].token_ids
    batch = llm.open_batch(capacity=1)
    try:
        [slot] = llm.admit([[5, 17, 300]], [sp])
        llm.step()
        with pytest.raises(RuntimeError, match=r"generate\(\): the open batch has 1 unfinished row"):
            llm.generate([[8, 9]], sp)
        with pytest.raises(RuntimeError, match="unfinished row"):
            llm.score([8, 9])
        while slot in batch.live:
            llm.step()
        assert llm.release(slot).token_ids == alone
        llm.generate([[8, 9]], SamplingParams(max_tokens=2))  # nothing unfinished: allowed
    finally:
        llm.batch = None


def test_score_takes_a_sequence_that_fills_the_context(llm):
    ids = [(7 * i) % 300 + 1 for i in range(llm.max_model_len)]
    assert llm.score(ids).shape == (llm.max_model_len, llm.config.vocab_size)
    with pytest.raises(ValueError, match=f"has {llm.max_model_len + 1} tokens; the context holds"):
        llm.score(ids + [1])


def test_prompts_of_the_wrong_kind_are_named(llm):
    for bad, kind in ((5, "int"), (None, "None"), (3.5, "float")):
        with pytest.raises(TypeError, match=f"prompts is {kind}; expected a string"):
            llm.generate(bad)
    np = pytest.importorskip("numpy")
    sp = SamplingParams(max_tokens=3, stop_token_ids=[])
    assert (
        llm.generate(np.array([5, 17, 300]), sp)[0].token_ids == llm.generate([5, 17, 300], sp)[0].token_ids
    )
    assert len(llm.generate(np.array([[5, 17], [8, 9]]), sp)) == 2


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).stop == ()


def test_capture_is_refused_during_a_suspended_stream(llm, monkeypatch):
    """capture() runs its warm-ups on the cache rows as scratch (here its guard only: no CUDA here)."""
    monkeypatch.setattr(llm, "graphs", True)
    g = llm.stream([5, 17, 300], SamplingParams(max_tokens=8, stop_token_ids=[]))
    next(g)
    with pytest.raises(RuntimeError, match=r"capture\(\): a stream\(\) of this LLM is still being iterated"):
        llm.capture()
    g.close()
