"""(b) The int4 pack/unpack/dequant of k26 is bit-for-bit compressed-tensors'."""

import pytest
import torch

# A test dependency (the `test` extra installs it); the bare GPU loaner lacks it, and collecting the
# suite there with `-m gpu` must not fail on this CPU-only module.
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from k26.ops import dequantize_int4, pack_int4, quantize_int4, unpack_int4


def codes(*shape, seed=0):
    q = torch.randint(-8, 8, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    q.view(-1)[:2] = torch.tensor([-8, 7], dtype=torch.int8)  # both extremes, incl. the sign-bit nibble
    return q


def test_pack_matches_compressed_tensors():
    q = codes(48, 96)
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4))


def test_unpack_matches_compressed_tensors():
    packed = torch.randint(
        -(2**31), 2**31 - 1, (32, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(unpack_int4(packed), unpack_from_int32(packed, 4, torch.Size([32, 128])))


def test_stacked_experts_round_trip():
    q = codes(3, 16, 64, seed=2)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_dequantize_matches_compressed_tensors():
    q = codes(16, 64, seed=3)
    s = (torch.rand(16, 2, generator=torch.Generator().manual_seed(4)) + 0.1).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    ref = dequantize(q, s, args=args, dtype=torch.bfloat16)
    assert torch.equal(dequantize_int4(pack_int4(q), s, torch.bfloat16), ref)


def test_quantize_is_symmetric_absmax_over_7():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    packed, s = quantize_int4(w)
    q = unpack_int4(packed)
    assert q.min() >= -7 and q.max() <= 7
    err = (dequantize_int4(packed, s, torch.float32) - w).abs()
    assert (err <= s.float().repeat_interleave(32, -1) * 0.51 + 1e-3).all()
