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
