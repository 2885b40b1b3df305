"""The one-launch in-place rotary embedding against transformers' formula (``ref_rotary``): under
the Triton interpreter on CPU, and compiled on a GPU (where half precision is bit-equal: each
product and the sum round as torch rounds them)."""

from __future__ import annotations

import pytest
import torch

from lorastar.kernels.reference import ref_rotary
from lorastar.kernels.rotary import rotary_

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (tokens, q heads, kv heads, head dim, rotary dims): SmolLM2's 9 + 3 heads of 64; TinyLlama's
# 32 + 4; partial rotary (Phi-2 / StableLM style); a half width that is not a power of two
SHAPES = [(1, 9, 3, 64, 64), (7, 32, 4, 64, 64), (5, 4, 2, 128, 64), (3, 2, 1, 96, 96), (33, 14, 2, 64, 32)]


def _tables(t: int, r: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows of random positions, built as RotaryEmbedding builds them (both halves equal)."""
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    pos = torch.randint(0, 4096, (t,), generator=gen).float()
    f = pos[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)  # a fused qkv output


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the dtype's rounding; on a GPU half precision is bit-equal almost everywhere (the
    interpreter casts fp32 to bf16 by truncation, a GPU rounds to nearest)."""
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2 if want.is_cuda else 2.4e-2}
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol[want.dtype], atol=2e-2)
    if want.is_cuda and want.dtype != torch.float32:
        assert (got == want).float().mean().item() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d", "r"), SHAPES)
def test_rotary_matches_reference_in_place(
    t: int, hq: int, hkv: int, d: int, r: int, dtype: torch.dtype
) -> None:
    """q and k heads rotated in one call over a strided view of the fused qkv output, as the
    decoder calls it: the view is rotated in place, v and the pass-through dims are untouched."""
    gen = torch.Generator().manual_seed(t * 1000 + d + r)
    qkv = _qkv(t, hq, hkv, d, dtype, gen)
    before = qkv.clone()
    cos, sin = _tables(t, r, dtype, gen)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    want = ref_rotary(qk.clone(), cos, sin)
    got = rotary_(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    _check(qk, want)
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v
    assert torch.equal(qk[..., r:], before[:, : (hq + hkv) * d].view(t, hq + hkv, d)[..., r:])


def test_rotary_matches_the_layer_and_refuses_bad_tables() -> None:
    """The reference is the layer's own torch path (RotaryEmbedding, partial rotary included)."""
    from lorastar.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding({"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 64, 512)
    positions = torch.randint(0, 512, (6,), generator=gen)
    q, k = torch.randn(6, 4, 64, generator=gen), torch.randn(6, 2, 64, generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want_q, want_k = rope(positions, q, k)
    _check(rotary_(q.clone(), cos[:, 0], sin[:, 0]), want_q)
    _check(rotary_(k.clone(), cos[:, 0], sin[:, 0]), want_k)
    assert rotary_(torch.empty(0, 4, 64), cos[:0, 0], sin[:0, 0]).shape == (0, 4, 64)
    with pytest.raises(ValueError, match="r even"):
        rotary_(q, cos[:, 0, :31], sin[:, 0, :31])
    with pytest.raises(ValueError, match="contiguous"):
        rotary_(q.transpose(1, 2).contiguous().transpose(1, 2), cos[:, 0], sin[:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_rotary_gpu(t: int, dtype: torch.dtype) -> None:
    """Compiled at serving sizes (TinyLlama's 32 + 4 heads of 64; Llama-3-8B's 32 + 8 of 128)."""
    gen = torch.Generator().manual_seed(t)
    for hq, hkv, d in ((32, 4, 64), (32, 8, 128)):
        qkv = _qkv(t, hq, hkv, d, dtype, gen).cuda()
        cos, sin = (x.cuda() for x in _tables(t, d, dtype, gen))
        qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        want = ref_rotary(qk.clone(), cos, sin)
        _check(rotary_(qk, cos, sin), want)
