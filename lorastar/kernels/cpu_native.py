"""Small C++ ops for the CPU's steps, built together once per machine with torch's extension
builder (semantics in each source file and in ``reference.py``):

* ``paged_decode`` (``csrc/cpu_attention.cpp``, ``ref_paged_attention``): the torch path gathers
  every decode row's blocks into a new tensor per layer and step (``index_select``) and SDPA reads
  the copy again; the op reads each cached K/V byte once, straight from its block.
* ``lora_segments`` (``csrc/cpu_lora.cpp``, ``ref_lora_shrink``/``ref_lora_expand``): SGMV over
  (slot, rows) segments reading each adapter's A and B once per linear at its true rank; the torch
  form (``bmm`` over a slot grid) read every slot at the step's largest rank.
* ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary`` (``csrc/cpu_elementwise.cpp``,
  ``ref_rms_norm``/``ref_silu_and_mul``/``ref_rotary``): one pass each where torch's composite forms
  dispatch 3-8 ops; at a decode step's sizes the dispatch is most of their cost.

All take fp32 or bf16 (computed in fp32, rounded to bf16 where torch's bf16 forms round:
``csrc/cpu_elementwise.cpp``, ``csrc/cpu_attention.cpp``; LoRA where the GPU kernels round,
``csrc/cpu_lora.cpp``).

The build (g++ and the ``ninja`` wheel's binary, whatever ninja the system has; 25 s on 2 cores, cached
under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, a folder per source and flag set:
``build_name``) happens on the first ``load()``; where it cannot build, ``load()`` returns ``None``
and callers keep the torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# A build killed midway (Ctrl-C on the first start) leaves torch's lock file behind, and every later
# build waits on it forever; a build takes ~20 s, so a lock this old is stale.
STALE_LOCK_SECONDS = 300.0

# What every op takes (one dtype per call); callers check against it.
DTYPES = (torch.float32, torch.bfloat16)

_CSRC = Path(__file__).with_name("csrc")
# Compiled each on its own (in parallel where there are cores): the ops include only ATen's core
# headers and the bindings torch's Python ones, where one load_inline file of everything parsed
# <torch/extension.h> (28 s here) before any of its own code. Build on 2 cores, ninja's own log:
# 37.2 s as that one file, 25.5 s now (the longest source, cpu_attention.cpp, takes 13 s alone).
_COMPILED = [
    _CSRC / f
    for f in ("cpu_attention.cpp", "cpu_lora.cpp", "cpu_elementwise.cpp", "cpu_int8.cpp", "cpu_bindings.cpp")
]
# Everything the build reads, headers included, names it (build_name): an edit anywhere rebuilds.
_SOURCES = [_CSRC / "cpu_vec.h", _CSRC / "cpu_ops.h", *_COMPILED]
_state: dict[str, ModuleType | None] = {}


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir/lock`` if it is older than ``max_age`` seconds; True if removed."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age:
            lock.unlink()
            log.warning("removed a stale build lock %s (a build was interrupted)", lock)
            return True
    except FileNotFoundError:
        pass
    return False


@contextlib.contextmanager
def _one_ninja() -> Iterator[None]:
    """Builds run the ``ninja`` wheel's binary (a dependency) whatever else ``PATH`` holds; ``PATH``
    is restored afterwards.

    ninja 1.12 changed the command hash in ``.ninja_log``, so a machine with a system ninja 1.11
    (Debian's ``ninja-build``) rebuilt the op (~30 s) each time a process with the venv's ``bin/``
    on ``PATH`` (``lorastar serve``) and one without it (``.venv/bin/python``) took turns: the test
    suite paid three rebuilds per run. Only without the wheel does the system's ninja build."""
    try:
        import ninja
    except ImportError:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + (old or "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def cpu_identity() -> str:
    """This CPU's model name and feature flags (``/proc/cpuinfo``'s first processor; elsewhere what
    ``platform`` knows): what a ``-march=native`` build was compiled for."""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, aarch64
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            first = itertools.takewhile(lambda ln: ln.strip(), f)  # the first processor's block
            keep = [ln.strip() for ln in first if ln.startswith(keys)]
        if keep:
            return "\n".join(keep)
    return f"{platform.machine()} {platform.processor()}"


def build_name(sources: list[str], flags: list[str]) -> str:
    """The build's name (and so its folder): ``lorastar_cpu_ops_`` and a digest of the sources, the
    flags and the include folder, and for a ``-march=native`` build the CPU (``cpu_identity``).
    torch keeps one folder per name and rebuilds (~30 s) whenever the sources or the command differ
    from its last build there, so two checkouts or two versions of lorastar (a benchmark's
    ``--other``, two venvs) or ``LORASTAR_CPU_NATIVE`` on and off shared one folder and rebuilt at
    every switch; now each builds once. The command does not change with the CPU, so a cache folder
    shared by different machines (a home folder on NFS, a container image built elsewhere) loaded
    code compiled for another CPU, which can die on an instruction this one lacks (SIGILL); now each
    CPU builds its own."""
    parts = [*sources, *flags, str(_CSRC)]
    if "-march=native" in flags:
        parts.append(cpu_identity())
    h = hashlib.sha256("\0".join(parts).encode())
    return f"lorastar_cpu_ops_{h.hexdigest()[:16]}"


def load() -> ModuleType | None:
    """The compiled ops (built on first call, then cached), or ``None`` if they cannot build."""
    if "ext" in _state:
        return _state["ext"]
    ext: ModuleType | None = None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        # -fopenmp: at::parallel_for is an inline `omp parallel` (torch's backend here is OpenMP); the
        # op links libgomp.so.1, which resolves to the copy torch already loaded: one thread pool.
        flags = ["-O3", "-fopenmp"]
        if os.environ.get("LORASTAR_CPU_NATIVE", "1") != "0":
            flags.append("-march=native")
        sources = [src.read_text() for src in _SOURCES]
        name = build_name(sources, flags)
        clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
        t0 = time.perf_counter()
        with _one_ninja():
            ext = load_extension(
                name,
                sources=[str(src) for src in _COMPILED],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(_CSRC)],
                verbose=False,
            )
        if (took := time.perf_counter() - t0) > 2.0:  # a build, not a load from the cache
            log.info("built the CPU ops in %.0f s (cached for later starts)", took)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, no headers: keep the torch path
        log.warning("the CPU ops did not build (%s); using the torch paths", e)
    _state["ext"] = ext
    return ext


def _ops() -> ModuleType:
    ext = load()
    if ext is None:
        raise RuntimeError("the CPU ops are not available on this machine")
    return ext


def paged_decode(
    q: torch.Tensor,  # [T, Hq, D] fp32 or bf16 (the caches and out the same)
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    rows: torch.Tensor,  # [Bd] int64: the decode rows of q
    gather: torch.Tensor,  # [Bd, nblk] int64: row b's blocks from the one holding lo[b]
    lo: torch.Tensor,  # [Bd] int64: first key position row b sees
    lens: torch.Tensor,  # [Bd] int64: context length (row b sits at lens[b] - 1)
    out: torch.Tensor,  # [T, Hq, D]: rows written in place
    *,
    scale: float,
    softcap: float = 0.0,
    tiled: bool = True,
) -> torch.Tensor:
    """Semantics: ``out[rows[b], h] = softmax(cap(scale * q[rows[b], h] @ K[lo[b]:lens[b], h // G].T))
    @ V[lo[b]:lens[b], h // G]``, K/V read block-wise from the caches (see ``csrc/cpu_attention.cpp``).
    ``tiled=False`` keeps the generic form where the tiled one would run (``decode_tiled()``)."""
    _ops().paged_decode(q, k_cache, v_cache, rows, gather, lo, lens, out, scale, softcap, tiled)
    return out


def decode_tiled() -> bool:
    """Whether this machine's build has ``paged_decode``'s tiled form (built for AVX-512: 16 keys'
    scores at a time; ~1.8x the generic form on SmolLM2's heads), used for head sizes 16-128 in
    steps of 16 and 256, with blocks of a multiple of 16 tokens."""
    return bool(_ops().paged_decode_tiled())


def lora_segments(
    x: torch.Tensor,  # [T, H] fp32 or bf16
    y: torch.Tensor,  # [T, Ntot] x's dtype, updated in place
    a: list[torch.Tensor],  # per slice [S, R, H]
    b: list[torch.Tensor],  # per slice B transposed [S, R, N_i], scaling folded in
    offsets: list[int],  # first column of each slice in y
    segs: list[int],  # flat (slot, start, end) triples
    ranks: list[int],  # [S] each slot's rank in this linear (0: skipped)
    shared: list[bool],  # [S] every slice of the slot holds the same A
) -> None:
    """Semantics: ``for slot, s, e in segs: for i: y[s:e, off_i:off_i+N_i] += (x[s:e] @ A_i[slot, :r].T)
    @ Bt_i[slot, :r]`` with ``r = ranks[slot]``; every tensor fp32 or every one bf16 (bf16: the shrink
    rounded to bf16, y + delta rounded once, as ``ref_lora_shrink``/``ref_lora_expand``; see
    ``csrc/cpu_lora.cpp``)."""
    _ops().lora_segments(x, y, a, b, offsets, segs, ranks, shared)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: ``weight * (x * rsqrt(mean(x**2, -1) + eps))``; x ``[N, D]`` fp32 or bf16 (weight
    the same) with contiguous rows -> a new ``[N, D]`` (``csrc/cpu_elementwise.cpp``; ``ref_rms_norm``)."""
    return _ops().rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: ``s = x + h; return s, rms_norm(s, weight, eps)``, one pass (a residual add and the
    next norm); x, h ``[N, D]`` fp32 or bf16 with contiguous rows."""
    return _ops().add_rms_norm(x, h, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: ``silu(gate_up[:, :I]) * gate_up[:, I:]``; gate_up ``[N, 2I]`` fp32 or bf16 with
    contiguous rows -> ``[N, I]`` (``ref_silu_and_mul``)."""
    return _ops().silu_and_mul(gate_up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics: ``x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin`` per head; x ``[T, H, D]`` fp32
    or bf16 with contiguous heads (a view of the fused qkv output), cos/sin ``[T, D]`` of x's dtype (any
    ``[T, 1, D]`` view of them) -> a new contiguous ``[T, H, D]`` (``ref_rotary``)."""
    return _ops().rotary(x, cos, sin)


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """q ``[N, K]`` int8 -> ``[ceil(N / 16), K, 16]``: sixteen table rows side by side (rows past N
    zero), the layout ``int8_logits`` reads."""
    return _ops().int8_pack(q)


def int8_logits(x: torch.Tensor, qp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Semantics: ``(x @ q.float().T) * scale``; x ``[M, K]`` fp32 contiguous, qp ``int8_pack(q)``, scale
    ``[N]`` fp32 -> ``[M, N]`` fp32 (``csrc/cpu_int8.cpp``; ``ref_int8_logits``): a per-row int8
    lm_head (``quant/embedding_int8.py``) read once per step, one byte an element."""
    return _ops().int8_logits(x, qp, scale)
