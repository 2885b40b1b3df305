"""The CPU paged decode op (``kernels/cpu_native.py``, C++) against the plain reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from lorastar.kernels import cpu_native
from lorastar.kernels.reference import ref_lora_expand, ref_lora_shrink, ref_paged_attention


def _op() -> None:
    if cpu_native.load() is None:
        if shutil.which("g++") and shutil.which("ninja"):
            pytest.fail("g++ and ninja are here but the CPU attention op did not build")
        pytest.skip("no C++ toolchain: the CPU attention op cannot build here")


def _case(
    ctx_lens: list[int], hq: int, hkv: int, d: int, bs: int, window: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Decode rows (one new token each) over shuffled blocks of a NaN-poisoned cache; blocks wholly
    before every row's window are -1 in the table (freed) and never read, and slots past a row's
    context in its last block are NaN."""
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in ctx_lens) + 3
    k_cache = torch.full((nb, bs, hkv, d), float("nan"))
    v_cache = k_cache.clone()
    perm = torch.randperm(nb, generator=gen).tolist()
    mb = max(-(-n // bs) for n in ctx_lens)
    tables = torch.full((len(ctx_lens), mb), -1, dtype=torch.int32)
    for b, n in enumerate(ctx_lens):
        lo = max(0, n - window) if window else 0
        for j in range(-(-n // bs)):
            blk = perm.pop()
            tables[b, j] = blk
            k_cache[blk] = torch.randn(bs, hkv, d, generator=gen)
            v_cache[blk] = torch.randn(bs, hkv, d, generator=gen)
        if n % bs:  # the last block's slots past the context: never written, so never read
            k_cache[tables[b, n // bs], n % bs :] = float("nan")
            v_cache[tables[b, n // bs], n % bs :] = float("nan")
        for j in range(lo // bs):  # freed by the block manager: poisoned and unmapped
            k_cache[tables[b, j]] = float("nan")
            v_cache[tables[b, j]] = float("nan")
            tables[b, j] = -1
    # q rows strided, as the model's view into its fused qkv output; row 1 is a prefill row (not ours).
    t = len(ctx_lens) + 1
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2
    q = qkv[:, : hq * d].view(t, hq, d)
    rows = torch.tensor([0] + list(range(2, t)), dtype=torch.int64)
    return q, k_cache, v_cache, tables, rows


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("bs", [1, 4, 16, 32])
@pytest.mark.parametrize("d", [64, 128, 24, 96, 112, 256])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (7, 0.0), (0, 5.0), (20, 5.0)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "generic"])
def test_paged_decode_matches_reference(
    hq: int, hkv: int, bs: int, d: int, window: int, softcap: float, tiled: bool
) -> None:
    """Both forms of the op (the tiled one where this build has it and d, bs allow: d 64, 96, 128,
    112 and 256 with blocks of 16 or 32; the generic one everywhere)."""
    _check_decode(hq, hkv, bs, d, window, softcap, tiled, torch.float32)


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (8, 1)])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("d", [64, 24, 128])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 5.0)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "generic"])
def test_paged_decode_in_bf16_matches_reference(
    hq: int, hkv: int, bs: int, d: int, window: int, softcap: float, tiled: bool
) -> None:
    """bf16 q and caches: computed in fp32 from the bf16 values and rounded once, so within one bf16
    ulp of the reference's fp32 result on the same inputs, rounded (almost always equal to it)."""
    _check_decode(hq, hkv, bs, d, window, softcap, tiled, torch.bfloat16)


def _check_decode(
    hq: int, hkv: int, bs: int, d: int, window: int, softcap: float, tiled: bool, dtype: torch.dtype
) -> None:
    _op()
    if tiled and not cpu_native.decode_tiled():
        pytest.skip("this build has no tiled form (built without AVX-512)")
    ctx_lens = [1, 5, 16, 17, 40, 3, 33]
    q, k_cache, v_cache, tables, rows = (
        t.to(dtype) if t.is_floating_point() else t for t in _case(ctx_lens, hq, hkv, d, bs, window)
    )
    lens = torch.tensor(ctx_lens, dtype=torch.int64)
    lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    first = lo // bs
    nblk = int(((lens + bs - 1) // bs - first).max())
    idx = (first[:, None] + torch.arange(nblk)[None, :]).clamp(max=tables.shape[1] - 1)
    gather = tables.long().gather(1, idx).clamp(min=0).contiguous()
    out = torch.full((q.shape[0], hq, d), 7.0, dtype=dtype)
    cpu_native.paged_decode(
        q, k_cache, v_cache, rows, gather, lo, lens, out, scale=d**-0.5, softcap=softcap, tiled=tiled
    )
    assert torch.equal(out[1], torch.full((hq, d), 7.0, dtype=dtype))  # a row not in `rows` is left alone
    qd = q[rows]
    ref = ref_paged_attention(
        qd, k_cache, v_cache, tables.clamp(min=0), lens.int(), torch.arange(len(ctx_lens) + 1, dtype=torch.int32),
        scale=d**-0.5, sliding_window=window, softcap=softcap,
    )  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(out[rows], ref, atol=2e-5, rtol=2e-5)
        return
    assert ref.dtype == torch.bfloat16  # the reference rounds its fp32 result to q's dtype
    torch.testing.assert_close(out[rows].float(), ref.float(), atol=1e-6, rtol=2**-7)  # one ulp
    assert (out[rows] != ref).float().mean() < 0.02


def test_paged_decode_rejects_what_it_cannot_read() -> None:
    _op()
    q, k_cache, v_cache, tables, rows = _case([5, 9], 4, 2, 16, 4, 0)
    lens, lo = torch.tensor([5, 9]), torch.zeros(2, dtype=torch.int64)
    gather = tables.long().clamp(min=0)
    out = torch.empty(q.shape[0], 4, 16)
    with pytest.raises(RuntimeError, match="all fp32 or all bf16"):
        cpu_native.paged_decode(q.half(), k_cache, v_cache, rows, gather, lo, lens, out, scale=1.0)
    with pytest.raises(RuntimeError, match="all fp32 or all bf16"):  # a bf16 cache under fp32 q
        cpu_native.paged_decode(
            q, k_cache.bfloat16(), v_cache.bfloat16(), rows, gather, lo, lens, out, scale=1.0
        )
    with pytest.raises(RuntimeError, match="int64"):
        cpu_native.paged_decode(q, k_cache, v_cache, rows.int(), gather, lo, lens, out, scale=1.0)


def _lora_case(shared: bool, max_rank: int) -> tuple:
    """Three slices (q/k/v-like widths), slots of mixed true ranks (one 0: the slot does not target
    this linear), segments of 1-5 rows in slot order with base rows between them, y a strided view;
    ``shared``: every slice of a slot holds the same A (fused-module LoRA), one shrink for all."""
    gen = torch.Generator().manual_seed(2)
    h, widths, num_slots = 40, [24, 8, 8], 6
    ranks = [max_rank, 0, max(1, max_rank // 4), 3, max_rank // 2, 1]
    a = [torch.zeros(num_slots, max_rank, h) for _ in widths]
    b = [torch.zeros(num_slots, n, max_rank) for n in widths]
    for s, r in enumerate(ranks):
        a0 = torch.randn(r, h, generator=gen)
        for i, n in enumerate(widths):
            a[i][s, :r] = a0 if shared else torch.randn(r, h, generator=gen)
            b[i][s, :, :r] = torch.randn(n, r, generator=gen)
    segs = [0, 1, 3, 1, 3, 5, 2, 5, 10, 3, 11, 12, 5, 12, 12, 4, 12, 14]  # (slot, start, end)
    x = torch.randn(14, h, generator=gen)
    wide = torch.randn(14, sum(widths) + 5, generator=gen)
    return a, b, segs, x, wide, ranks, widths, [0, 24, 32]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("max_rank", [8, 64])
def test_lora_segments_matches_reference(shared: bool, max_rank: int) -> None:
    """The case of ``_lora_case`` in fp32."""
    _op()
    a, b, segs, x, wide, ranks, widths, offsets = _lora_case(shared, max_rank)
    num_slots = len(ranks)
    y = wide[:, 5:]  # strided rows
    y0 = y.clone()
    bt = [bb.transpose(1, 2).contiguous() for bb in b]  # the CPU slots' layout, B.T [S, R, N]
    cpu_native.lora_segments(x, y, a, bt, offsets, segs, ranks, [shared] * num_slots)
    ref = y0.clone()
    for k in range(0, len(segs), 3):
        slot, s, e = segs[k : k + 3]
        r = ranks[slot]
        for i, off in enumerate(offsets):
            ref[s:e, off : off + widths[i]] += (x[s:e] @ a[i][slot, :r].T) @ b[i][slot, :, :r].T
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[0], y0[0]) and torch.equal(y[10], y0[10])  # base rows untouched
    with pytest.raises(RuntimeError, match="segment out of range"):
        cpu_native.lora_segments(x, y, a, bt, offsets, [0, 10, 15], ranks, [shared] * num_slots)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("max_rank", [8, 64])
def test_lora_segments_in_bf16_matches_reference(shared: bool, max_rank: int) -> None:
    """The same case in bf16 against ``ref_lora_shrink`` then ``ref_lora_expand`` per slice (the
    GPU kernels' semantics: the shrink rounded to bf16, y + delta summed in fp32 and rounded once):
    within one bf16 ulp, nearly all equal. Mixed dtypes are refused."""
    _op()
    a, b, segs, x, wide, ranks, widths, offsets = _lora_case(shared, max_rank)
    num_slots = len(ranks)
    a, b, x, wide = [t.bfloat16() for t in a], [t.bfloat16() for t in b], x.bfloat16(), wide.bfloat16()
    y = wide[:, 5:]
    y0 = y.clone()
    bt = [bb.transpose(1, 2).contiguous() for bb in b]
    cpu_native.lora_segments(x, y, a, bt, offsets, segs, ranks, [shared] * num_slots)
    slots = torch.full((x.shape[0],), -1, dtype=torch.int32)
    for k in range(0, len(segs), 3):
        slots[segs[k + 1] : segs[k + 2]] = segs[k]
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    ref = y0.clone()
    for i, off in enumerate(offsets):
        buf = ref_lora_shrink(x, a[i], slots, ranks_t)  # [T, R] bf16
        ref = ref_lora_expand(ref, buf, b[i], slots, ranks_t, off)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-6, rtol=2**-7)  # one ulp
    assert (y != ref).float().mean() < 0.02
    assert torch.equal(y[0], y0[0]) and torch.equal(y[10], y0[10])
    assert not torch.equal(y, y0)
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        cpu_native.lora_segments(x, y.float(), a, bt, offsets, segs, ranks, [shared] * num_slots)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        cpu_native.lora_segments(x, y, [t.float() for t in a], bt, offsets, segs, ranks, [shared] * num_slots)


def test_a_stale_build_lock_is_cleared(tmp_path) -> None:  # noqa: ANN001
    """torch's builder waits forever on a lock an interrupted build left; ours removes an old one."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not cpu_native.clear_stale_lock(tmp_path)  # a build may be running: left alone
    assert lock.exists()
    old = time.time() - cpu_native.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    assert cpu_native.clear_stale_lock(tmp_path) and not lock.exists()
    assert not cpu_native.clear_stale_lock(tmp_path)  # nothing to remove


def test_the_build_runs_the_wheels_ninja_whatever_path_holds(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """ninja 1.11 and 1.12+ hash commands differently in ``.ninja_log``: a system ninja used by one
    process and the wheel's by another rebuilt the op (~30 s) at every switch. The build sees the
    wheel's ninja first on ``PATH`` even when another one comes first, and ``PATH`` comes back."""
    import os
    import shutil

    import ninja
    import torch.utils.cpp_extension as cpp

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.11.1\n")
    other.chmod(0o755)
    path = str(tmp_path) + os.pathsep + os.environ["PATH"]
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    seen: list[str | None] = []
    sentinel = object()

    def fake_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(shutil.which("ninja"))
        return sentinel

    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(cpu_native, "_state", {})
    assert shutil.which("ninja") == str(other)
    assert cpu_native.load() is sentinel
    assert seen and seen[0] is not None and os.path.samefile(os.path.dirname(seen[0]), ninja.BIN_DIR)
    assert os.environ["PATH"] == path


def test_each_source_and_flag_set_builds_in_its_own_folder(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """torch rebuilds (~30 s) when a name's sources or command change, so two lorastar versions,
    two checkouts, or ``LORASTAR_CPU_NATIVE`` on and off took turns rebuilding one folder; each
    combination now has its own name."""
    import torch.utils.cpp_extension as cpp

    names: list[str] = []

    def fake_load(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        names.append(name)
        return object()

    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the folders it names, not the user's
    for native in ("1", "0", "1"):
        monkeypatch.setenv("LORASTAR_CPU_NATIVE", native)
        monkeypatch.setattr(cpu_native, "_state", {})
        cpu_native.load()
    assert names[0] == names[2] != names[1]
    assert all(n.startswith("lorastar_cpu_ops_") and n.isidentifier() for n in names)
    base = cpu_native.build_name(["src"], ["-O3"])
    assert base == cpu_native.build_name(["src"], ["-O3"])
    assert len({base, cpu_native.build_name(["src2"], ["-O3"]), cpu_native.build_name(["src"], ["-O2"])}) == 3


def test_a_native_build_is_named_for_its_cpu(monkeypatch) -> None:  # noqa: ANN001
    """A ``-march=native`` build runs only on CPUs with the features it was compiled for; a cache
    folder shared by two machines (home on NFS, an image built elsewhere) must not hand one CPU's
    build to the other."""
    assert cpu_native.cpu_identity().strip()  # something to tell CPUs apart
    native = ["-O3", "-march=native"]
    monkeypatch.setattr(cpu_native, "cpu_identity", lambda: "model name : A\nflags : avx512f")
    a_native, a_plain = cpu_native.build_name(["src"], native), cpu_native.build_name(["src"], ["-O3"])
    monkeypatch.setattr(cpu_native, "cpu_identity", lambda: "model name : B\nflags : avx2")
    assert cpu_native.build_name(["src"], native) != a_native
    assert cpu_native.build_name(["src"], ["-O3"]) == a_plain  # a portable build is shared
