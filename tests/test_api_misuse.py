"""The Python API misused as a user might: each mistake named in one message before anything loads or any row
is taken (devices k26 does not run on, empty paths, on / off arguments that are not bools, the
continuous-batching calls out of order or with mismatched lists, SpecConfig fields that are not sequences,
chat messages that are not a list, torchrun variables that are no count)."""

import pytest
import torch

import k26.engine
from k26 import LLM, SamplingParams, SpecConfig, Tokenizer
from k26.chat import render


class _Loaded(Exception):
    """Raised by the stand-in load_model: start-up got past the checks to reading weights."""


@pytest.fixture
def no_loading(monkeypatch):
    def load(*a, **kw):
        raise _Loaded

    monkeypatch.setattr(k26.engine, "load_model", load)


@pytest.fixture(scope="module")
def llm(tiny_k25):
    return LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_model_len=64, max_batch=2)


@pytest.mark.parametrize("device", ["mps", "meta", torch.device("meta"), "xpu"])
def test_a_device_k26_does_not_run_on_is_refused_before_loading(tiny_k25, no_loading, device):
    """torch knows these device types; k26 does not run on them (mps failed mid-load with a dispatcher
    traceback, meta with 'can't convert meta device type tensor to numpy')."""
    with pytest.raises(ValueError, match=r"device=.*: expected 'cpu', 'cuda' or 'cuda:N'"):
        LLM(tiny_k25, device=device, progress=False)


@pytest.mark.parametrize("kw", [{"model_path": ""}, {"drafter": ""}, {"cache_dir": ""}])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(tiny_k25, no_loading, kw):
    """Path("") is ".": an unset variable (cache_dir=os.environ.get(...) or "") read or wrote there."""
    kw = {"model_path": tiny_k25, **kw}
    with pytest.raises(ValueError, match=f"{next(k for k, v in kw.items() if v == '')}='': an empty path"):
        LLM(kw.pop("model_path"), device="cpu", progress=False, **kw)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"absorb": "no"}, "absorb='no': expected True or False"),
        ({"prefix_cache": "0"}, "prefix_cache='0': expected True or False"),
        ({"compile": 1}, "compile=1: expected True or False"),
        ({"graphs": "yes"}, "graphs='yes': expected True or False (or None)"),
    ],
)
def test_on_off_arguments_that_are_not_bools_are_refused(tiny_k25, no_loading, kw, needle):
    """A string (an environment variable's "0", a "no") was taken for True, silently."""
    with pytest.raises(TypeError) as e:
        LLM(tiny_k25, device="cpu", progress=False, **kw)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "env", [{"WORLD_SIZE": "abc"}, {"WORLD_SIZE": "2", "RANK": "x"}, {"WORLD_SIZE": "2", "LOCAL_RANK": "1.5"}]
)
def test_a_torchrun_variable_that_is_no_count_is_named_before_any_group(
    monkeypatch, tiny_k25, no_loading, env
):
    """int()'s "invalid literal for int() with base 10: 'abc'" named neither the variable nor the
    environment."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    name, value = list(env.items())[-1]
    with pytest.raises(ValueError, match=f"^{name}='{value}' in the environment: expected an integer >="):
        LLM(tiny_k25, device="cpu", progress=False, tp=2)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("buckets", [[(1, 257)], [(1, 4), (2, 1000)]])
def test_a_bucket_wider_than_the_tree_kernel_is_refused_before_loading(tiny_k25, no_loading, buckets):
    """Verify tokens past 256 (a DDTree budget of 255) were taken, and failed only at the graph capture,
    after the whole load."""
    with pytest.raises(ValueError, match=r"^buckets: Bucket\(.*verify tokens; at most 256 "):
        LLM(tiny_k25, device="cpu", progress=False, max_batch=2, buckets=buckets)
    with pytest.raises(_Loaded):  # 256 itself is the kernel's: past the checks
        LLM(tiny_k25, device="cpu", progress=False, max_batch=2, buckets=[(2, 256)])


def test_continuous_batching_calls_misused_are_named_and_take_no_row(llm):
    """Without an open batch step / admit / release raised AttributeError on None; admit with fewer or more
    SamplingParams than prompts raised IndexError with a row already taken; a str of prompts was counted
    by its characters; release(-1) freed the last slot and release(5) raised IndexError; capacity=0 opened
    every row; logprobs="no" / wait="no" were taken as True."""
    assert llm.batch is None
    for call in (llm.step, lambda: llm.admit([[1, 2]], [SamplingParams()]), lambda: llm.release(0)):
        with pytest.raises(RuntimeError, match=r"(step|admit|release)\(\): no open batch; call open_batch"):
            call()
    for capacity in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"capacity={capacity}: expected 1..2"):
            llm.open_batch(capacity=capacity)
    with pytest.raises(TypeError, match="logprobs='no': expected True or False"):
        llm.open_batch(capacity=1, logprobs="no")
    batch = llm.open_batch(capacity=1)
    with pytest.raises(TypeError, match="wait='no': expected True or False"):
        llm.admit([[1, 2]], [SamplingParams()], wait="no")
    for params in ([], [SamplingParams(), SamplingParams()]):
        with pytest.raises(ValueError, match=rf"admit\(\): 1 prompts but {len(params)} SamplingParams"):
            llm.admit([[1, 2]], params)
    with pytest.raises(TypeError, match=r"admit\(\): prompts is a str; expected a list"):
        llm.admit("hi", [SamplingParams()])
    with pytest.raises(TypeError, match=r"admit\(\): params is a SamplingParams; expected a list"):
        llm.admit([[1, 2]], SamplingParams())
    assert batch.free_slots() == [0]  # nothing half admitted
    for slot in (1, -1, "0"):
        with pytest.raises(
            ValueError, match=r"release\(\): slot .* is not a slot of the open batch \(0..0\)"
        ):
            llm.release(slot)
    [slot] = llm.admit([[1, 2]], [SamplingParams(max_tokens=2, stop_token_ids=[])])
    while batch.live:
        llm.step()
    assert len(llm.release(slot).token_ids) == 2


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"candidates": 5}, "SpecConfig.candidates=5: ascending integer budgets"),
        ({"candidates": None}, "SpecConfig.candidates=None: ascending integer budgets"),
        ({"costs": 5}, "SpecConfig.costs=5: t_draft"),
        ({"candidates": (3,), "costs": (0, 1), "cost_per_token": 7}, "SpecConfig.cost_per_token=7: needs"),
    ],
)
def test_spec_config_fields_that_are_not_sequences_are_named(kw, needle):
    """They raised Python's own "'int' object is not iterable" / "has no len()", naming no field."""
    with pytest.raises(ValueError) as e:
        SpecConfig("ddtree", **kw)
    assert needle in str(e.value)


def test_chat_messages_that_are_none_or_empty_are_named(tiny_k25):
    """None raised "'NoneType' object is not iterable"; no message at all rendered a prompt of the system
    turn alone (the server answers 400 for it)."""
    tok = Tokenizer.from_dir(tiny_k25)
    with pytest.raises(ValueError, match="messages is a NoneType; expected a list of chat messages"):
        render(tok, None)
    with pytest.raises(ValueError, match="messages is empty"):
        render(tok, [])
    assert render(tok, iter([{"role": "user", "content": "hi"}])) == render(
        tok, [{"role": "user", "content": "hi"}]
    )


@pytest.mark.parametrize("ids", [5, None])
def test_token_ids_that_are_no_sequence_are_named(llm, ids):
    """score(5) and admit([None], ...) raised Python's "'int' / 'NoneType' object is not iterable", naming
    neither the argument nor the prompt."""
    kind = type(ids).__name__
    with pytest.raises(TypeError, match=rf"token_ids is a {kind}; expected a list of token ids"):
        llm.score(ids)
    batch = llm.open_batch(capacity=1)
    with pytest.raises(TypeError, match=rf"prompt 0 is a {kind}; expected a list of token ids"):
        llm.admit([ids], [SamplingParams()])
    assert batch.free_slots() == [0]


@pytest.mark.parametrize("bad", [{}, [], "", 0])
def test_empty_values_of_the_wrong_type_are_named_not_taken_for_the_defaults(llm, bad):
    """(Found in a bug hunt: `sampling or SamplingParams()` took {} for the defaults: 256 tokens decoded.)"""
    with pytest.raises(TypeError, match=f"sampling must be a k26.SamplingParams, got {type(bad).__name__}"):
        llm.generate([1, 2, 3], bad, SpecConfig("ar"))
    with pytest.raises(TypeError, match=f"spec must be a k26.SpecConfig, got {type(bad).__name__}"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2), bad)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"dtype": "bf16"}, "dtype='bf16'"),
        ({"dtype": torch.int8}, "dtype=torch.int8"),
        ({"buckets": 5}, "buckets=5"),
    ],
)
def test_a_dtype_or_buckets_of_the_wrong_kind_is_named_before_anything_is_built(kw, needle):
    """(Found in a bug hunt: with the embedded pair's drafter, "bf16" raised torch.empty's TypeError and
    torch.int8 "Only Tensors of floating point ... can require gradients" from the drafter's meta model, and
    buckets=5 "'int' object is not iterable": none named the argument.)"""
    with pytest.raises(ValueError) as e:
        LLM(device="cpu", **kw)
    assert needle in str(e.value)
