import shutil

import pytest
import torch

from k26.tiny import write_tiny_checkpoint, write_tiny_drafter


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA devices"))


@pytest.fixture(scope="session", autouse=True)
def one_cpu_thread():
    """The tiny test models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    barriers stall every op while another process holds a core (measured under load: a 21-token score
    1.2 s with 2 threads, 0.04 s with 1). TP ranks size themselves the same way (cores // world)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_k25(tmp_path_factory):
    """K2.5/K2.6 layout: kimi_k25 + text_config, language_model. prefix, int4 experts, 3 shards."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("k25"), flavour="k25", seed=1)


@pytest.fixture(scope="session")
def tiny_k2(tmp_path_factory):
    """K2-Thinking layout, with group-limited routing switched on to exercise that path."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("k2"), flavour="k2-thinking", seed=2, n_group=4, topk_group=2, shards=2
    )


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("bf16"), flavour="k25", quant="none", seed=3, shards=1
    )


@pytest.fixture(scope="session")
def tiny_tp(tmp_path_factory):
    """A target + drafter pair whose sharded dims divide by 4 (moe_intermediate_size 128 keeps whole int4
    groups of 32 at TP 4; 4 drafter heads)."""
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("tp"), seed=4, moe_intermediate_size=128, shards=2)
    return d, write_tiny_drafter(tmp_path_factory.mktemp("tpd"), d, layers=1, seed=2, heads=4, kv_heads=4)


@pytest.fixture(scope="session")
def drafter_dir(tiny_k25, tmp_path_factory):
    """A 2-layer DFlash drafter for tiny_k25 (the spec and graph tests' pair)."""
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_k25, layers=2, seed=5)


@pytest.fixture(scope="module")  # module: a test module's own drafter_dir, if it has one, is the one used
def cpu_pair(tiny_k25, drafter_dir):
    """Build an `LLM` of the tiny K2.5 target and its drafter on the CPU in float32 (keyword arguments:
    the rest of LLM's, e.g. max_batch, max_model_len)."""
    from k26 import LLM

    def make(**kw):
        return LLM(tiny_k25, drafter=drafter_dir, device="cpu", dtype=torch.float32, progress=False, **kw)

    return make


@pytest.fixture(scope="session")
def served():
    """The embedded pair behind a real server on a free loopback port (DDTree, CPU, float32), with the
    references the server tests compare to, computed before the engine thread owns the model."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from http_app import serving
    from served import CHAT, MODEL, PENALTIES_SP, PROMPTS, SPEC

    from k26 import LLM, SamplingParams
    from k26.chat import ChatFormat, render
    from k26.server import Engine, create_app

    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=8, max_model_len=96)
    # references first: once the engine runs, its thread alone may touch the model
    refs = {p: llm.generate(p, SamplingParams(max_tokens=12), SPEC)[0] for p in PROMPTS}
    short = {p: llm.generate(p, SamplingParams(max_tokens=2), SPEC)[0].text for p in PROMPTS}
    lp_ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, logprobs=3), SPEC)[0]
    scored = llm.generate(PROMPTS[2], SamplingParams(max_tokens=0, prompt_logprobs=1), SPEC)[0]
    penalized = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, **PENALTIES_SP), SPEC)[0]
    fmt = ChatFormat.for_model(llm.config.model_type)
    chats = {
        on: llm.generate(
            render(llm.tokenizer, CHAT, fmt.with_thinking(on)), SamplingParams(max_tokens=8), SPEC
        )[0]
        for on in (True, False)
    }
    engine = Engine(llm, SPEC, max_waiting=64)
    engine.start()
    with serving(create_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield {
            "url": url,
            "client": client,
            "engine": engine,
            "refs": refs,
            "short": short,
            "llm": llm,
            "chats": chats,
            "lp_ref": lp_ref,
            "scored": scored,
            "penalized": penalized,
        }
    engine.stop()


@pytest.fixture
def ckpt(tiny_k25, tmp_path):
    """A copy of the tiny K2.5 checkpoint a test may damage (test_load_cache.py has its own, of tiny_tp)."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_k25, d)
    return d


@pytest.fixture
def no_loading(monkeypatch):
    """Fails a test that reaches the weights (the CLI tests: every check must come first)."""
    import k26

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(k26, "LLM", refuse)
