"""Independent implementations k26 is checked against (transformers, compressed-tensors), and the random
inputs several test files share."""

import torch

from k26.hf_state import deepseek_v3_state
from k26.ops import pack_int4


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Leave NaN in the CUDA caching allocator's free blocks: any output element a kernel forgets shows up."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of a from b in bf16 units in the last place (b's ulp: 2^(exponent - 7))."""
    ulp = torch.ldexp(torch.ones_like(b.float()), torch.frexp(b.float()).exponent - 8)
    return (a.float() - b.float()).abs() / ulp.clamp_min(2.0**-133)


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 600) -> list[list[int]]:
    """n prompts of random ids with lengths in [lo, hi), drawn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def assert_diverges_only_at_near_ties(llm, prompts, want, got, gap: float = 0.25, rounded=None) -> None:
    """Greedy bf16 outputs `got` (a speculative method) against `want` (autoregressive decoding) of the same
    target: identical up to a first difference, if any, where the target's two best logits (llm.score of the
    prompt and the tokens both agree on) are within `gap` — the verify's batched forward and the decode step
    round differently in bf16, so an exact tie-break is not a property; a wrong token anywhere else is.
    `rounded`: the same target in bf16 (reference ops), for `want` from a float32 `llm`: at the difference the
    float32 lead of the wanted token over the one `got` chose must be below twice what bf16 rounding alone
    moves those two logits against each other there (a random tiny model's bf16 logits move by up to ~2 over
    a long prompt, on the CPU's reference ops as on the kernels), or below `gap`."""
    for p, a, o in zip(prompts, want, got, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, o.token_ids)) if x != y), None)
        if k is None:
            assert len(a.token_ids) == len(o.token_ids)
            continue
        ids = list(p) + a.token_ids[:k]
        exact = llm.score(ids)[-1]
        if rounded is None:
            top2 = exact.topk(2).values
            assert (top2[0] - top2[1]).item() < gap, (k, top2)
            continue
        x, y = a.token_ids[k], o.token_ids[k]
        moved = (exact - rounded.score(ids)[-1])[[x, y]]
        lead, tie = (exact[x] - exact[y]).item(), max(gap, 2 * abs((moved[0] - moved[1]).item()))
        assert lead < tie, (k, x, y, lead, tie)


def random_int4_experts(E: int, D: int, inter: int, g: torch.Generator, min_scale: float = 0.01) -> tuple:
    """E random experts in the checkpoint layout (compressed-tensors pack-quantized int4, one bf16 scale per
    32 inputs): gate, gate scale, up, up scale, down, down scale, drawn from `g` in that order."""

    def packed(o, i):
        return pack_int4(torch.randint(-8, 8, (E, o, i), generator=g, dtype=torch.int8))

    def scale(o, i):
        return (torch.rand(E, o, i // 32, generator=g) * 0.1 + min_scale).to(torch.bfloat16)

    return (
        packed(inter, D),
        scale(inter, D),
        packed(inter, D),
        scale(inter, D),
        packed(D, inter),
        scale(D, inter),
    )


def hf_oracle(path):
    """transformers' DeepseekV3ForCausalLM on the same checkpoint, float32, eager attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text, state = deepseek_v3_state(path, torch.float32)
    hf_cfg = DeepseekV3Config(**text)
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    model.load_state_dict(state, strict=True)
    return model


def finish(llm, slots: list[int]) -> list:
    """Step the open batch until `slots` finished; release them; their outputs."""
    while any(llm.batch.outs[s].finish_reason is None for s in slots):
        llm.step()
    return [llm.release(s) for s in slots]


def assert_answers_as_fresh(llm, out, prompt, sp, spec):
    """`out` (a row of an open batch, logprobs asked) has a fresh `generate`'s tokens and logprobs (1e-4);
    returns the fresh output."""
    import pytest

    fresh = llm.generate(prompt, sp, spec)[0]
    assert out.token_ids == fresh.token_ids
    assert [x.logprob for x in out.logprobs] == pytest.approx([x.logprob for x in fresh.logprobs], abs=1e-4)
    return fresh
