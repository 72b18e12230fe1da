"""NumPy values where the API takes numbers or token ids: taken as the Python ones they stand for."""

import pytest
import torch

from k26 import LLM, SamplingParams

np = pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def llm(tiny_k25):
    return LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_model_len=64, max_batch=2)


def test_numpy_scalars_in_sampling_params_are_taken_as_python_numbers():
    sp = SamplingParams(
        temperature=np.float32(0.5),
        top_p=np.float16(0.5),
        top_k=np.uint8(3),
        max_tokens=np.int32(4),
        seed=np.int64(7),
        stop_token_ids=np.array([3, 4]),
        logprobs=np.int64(2),
        logit_bias={np.int64(5): np.float32(1.5)},
        min_tokens=np.int64(1),
    )
    assert sp == SamplingParams(0.5, 0.5, 3, 4, (3, 4), 7, logprobs=2, logit_bias={5: 1.5}, min_tokens=1)
    assert type(sp.seed) is int and type(sp.max_tokens) is int and type(sp.temperature) is float
    assert all(type(i) is int for i in sp.stop_token_ids)
    for bad in ({"seed": np.bool_(True)}, {"max_tokens": np.float64(3)}, {"temperature": np.float32("nan")}):
        with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(bad))}="):  # still refused
            SamplingParams(**bad)


def test_numpy_seed_samples_as_the_same_python_seed(llm):
    a = llm.generate([5, 17, 300], SamplingParams(max_tokens=6, temperature=1.0, seed=np.int64(11)))
    b = llm.generate([5, 17, 300], SamplingParams(max_tokens=6, temperature=1.0, seed=11))
    assert a[0].token_ids == b[0].token_ids


def test_numpy_id_arrays_in_a_list_of_prompts_are_token_ids(llm):
    sp = SamplingParams(max_tokens=3, stop_token_ids=[])
    mixed = llm.generate(["def f", np.array([5, 17, 300]), torch.tensor([8, 9])], sp)
    alone = llm.generate(["def f", [5, 17, 300], [8, 9]], sp)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    with pytest.raises(TypeError, match="prompt 1: token id"):
        llm.generate(["def f", np.array([[5, 17], [8, 9]])], sp)


def test_numpy_values_in_the_continuous_batching_calls(llm):
    # (refused as not integers / not lists once those calls checked their arguments, 45df161)
    batch = llm.open_batch(capacity=np.int64(2))
    assert batch.capacity == 2
    [slot] = llm.admit(np.array([[5, 17, 300]]), [SamplingParams(max_tokens=2, stop_token_ids=[])])
    while batch.live:
        llm.step()
    assert len(llm.release(np.int64(slot)).token_ids) == 2
