"""Shared helpers for the CPU benchmarks: environment line, prompts, tables, results, plots.

Every benchmark prints a markdown table, then writes ``<name>.md`` (table + the command and the
machine's load), ``<name>.json`` (raw numbers; gitignored) and ``<name>.png`` under ``--out``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

RESULTS = REPO / "benchmarks" / "results"

# Plain English words: prompts built from them tokenize to ordinary text, so every system sees the
# same realistic token distribution (no special or unseen tokens).
_WORDS = (
    "the of and to in is was for on that with as by at from his her are were this be which or had an "
    "not but have one all their has been its new more who also after first other two into time years "
    "would when there only some can out most up over such many three made than may these about later "
    "city world state school river music house water family story light people north game court war "
    "small old great long high large early young local public small final common early major open "
    "built played moved called wrote found began became turned opened known given taken held shown "
    "garden mountain bridge market village station island forest valley harbour castle library museum "
    "winter summer morning evening season journey letter window kitchen teacher doctor farmer sailor"
).split()


def setup_torch(threads: int = 2) -> None:
    """Fix the thread count (the machine has 2 cores; every system gets the same)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


def load_avg() -> tuple[float, float, float]:
    return os.getloadavg()


def env_line(extra: str = "") -> str:
    """One line describing where and under what load the numbers were taken."""
    import torch

    l1, l5, l15 = load_avg()
    parts = [
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        f"load average {l1:.2f} / {l5:.2f} / {l15:.2f} (1/5/15 min) at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
    ]
    if extra:
        parts.append(extra)
    return "; ".join(parts)


def command_line() -> str:
    rel = Path(sys.argv[0]).resolve()
    try:
        rel = rel.relative_to(REPO)
    except ValueError:
        pass
    return " ".join([".venv/bin/python", shlex.quote(str(rel)), *map(shlex.quote, sys.argv[1:])])


class LoadMonitor:
    """Samples the 1-minute load average while a benchmark runs (reported next to the results)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(load_avg()[0])

    def summary(self) -> str:
        if not self.samples:
            return "n/a"
        return f"min {min(self.samples):.2f}, max {max(self.samples):.2f}"


def text_prompts(tokenizer: Any, n: int, length: int | Sequence[int], seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of exactly ``length`` tokens (or ``length[i]``), each different from
    its first token on (so no two prompts share a prefix-cache block)."""
    rng = random.Random(seed)
    lengths = [length] * n if isinstance(length, int) else list(length)
    out: list[list[int]] = []
    for i, want in enumerate(lengths):
        words = [f"Story {i + 1}:"]
        ids: list[int] = []
        while len(ids) < want:
            words.extend(rng.choice(_WORDS) for _ in range(max(16, want)))
            ids = list(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
        out.append(ids[:want])
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:  # nan
                return "n/a"
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return "n/a" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str, out_dir: Path, sections: Sequence[str], data: dict[str, Any], *, notes: Sequence[str] = ()
) -> str:
    """Write ``name.md`` (command, environment, sections, notes) and ``name.json``; return the md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = [
        f"# {name}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Environment: {data.get('env', env_line())}",
        "",
    ]
    for s in sections:
        md += [s, ""]
    if notes:
        md += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    text = "\n".join(md)
    (out_dir / f"{name}.md").write_text(text)
    data = {"command": command_line(), **data}
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return text


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.2) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def log_x_axis(ax: Any, ticks: Sequence[int]) -> None:
    """Log-scaled x axis labelled exactly at ``ticks`` (no minor-tick labels)."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def save_figure(fig: Any, path: Path, title: str) -> None:
    import textwrap

    import matplotlib.pyplot as plt

    fig.suptitle("\n".join(textwrap.wrap(title, width=int(fig.get_figwidth() * 17))), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """``with timed() as t: ...`` then ``t()`` is the elapsed wall time in seconds."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def load_hf_model(attn_implementation: str | None = None, dtype: str = "float32") -> tuple[Any, Any]:
    """The same SmolLM2 checkpoint lorastar serves, as an HF transformers model (``dtype``, CPU, eval)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorastar.models.default import default_model_dir

    path = str(default_model_dir())
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tok


def hf_greedy_kwargs(tokenizer: Any, new_tokens: int) -> dict[str, Any]:
    """``generate`` kwargs for exactly ``new_tokens`` greedy tokens (EOS ignored, like ignore_eos)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": pad,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """Left-padded ``input_ids`` and ``attention_mask`` tensors for HF static batching."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    return ids, mask


def model_flops() -> dict[str, float]:
    """FLOPs of the embedded SmolLM2 (from its config.json): per token through the decoder layers
    (the linear layers, 2 x multiply-adds), per token through the LM head (only sampled positions
    need it), and attention per token per context position (QK^T and PV)."""
    from lorastar.models.default import default_model_dir

    cfg = json.loads((Path(default_model_dir()) / "config.json").read_text())
    h, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return {
        "layers": 2.0 * n * per_layer,
        "head": 2.0 * h * cfg["vocab_size"],
        "attn_per_ctx": 2.0 * 2 * n * q,
    }


def gemm_gflops(seconds: float = 2.0, rows: int = 256) -> float:
    """Sustained fp32 GEMM rate of this machine at the thread count set (the faster of torch's
    default and oneDNN with a prepacked weight), on the model's shapes:
    ``rows`` tokens through a 576 x 1536 projection. 256 rows: the roof for prefill and large
    batches; a decode step of B sequences has only B rows, and small-row GEMMs run slower."""
    import torch

    from lorastar.layers.cpu_gemm import onednn_available, pack, packed_linear

    x = torch.randn(rows, 576)
    w = torch.randn(1536, 576)
    fns = [lambda: x @ w.T]
    if onednn_available():  # the faster library bounds what any system can do here
        packed = pack(w)
        fns.append(lambda: packed_linear(x, packed))
    best = 0.0
    for fn in fns:
        for _ in range(5):
            fn()
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / len(fns):
            fn()
            n += 1
        best = max(best, n * 2.0 * rows * 576 * 1536 / (time.perf_counter() - t0) / 1e9)
    return best


_FMA_SRC = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
typedef float v16 __attribute__((vector_size(64)));
// 12 independent chains of 16-wide FMAs per thread (enough to cover FMA latency x ports).
double fma_loop(int64_t iters) {
  std::vector<double> sink(at::get_num_threads(), 0.0);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      v16 acc[12], m, a;
      for (int i = 0; i < 16; ++i) { m[i] = 0.999999f; a[i] = 1e-7f * i; }
      for (int j = 0; j < 12; ++j) acc[j] = a + (float)j;
      for (int64_t k = 0; k < iters; ++k)
        for (int j = 0; j < 12; ++j) acc[j] = acc[j] * m + a;
      double s = 0;
      for (int j = 0; j < 12; ++j) for (int i = 0; i < 16; ++i) s += acc[j][i];
      sink[t] = s;
    }
  });
  double s = 0;
  for (double x : sink) s += x;
  return s;
}
"""


def fma_peak_gflops(seconds: float = 1.0) -> float | None:
    """Measured fp32 FMA peak of this machine at the torch thread count: a C++ loop of independent
    16-wide FMA chains per thread (built with torch's extension builder, ``-march=native``); ``None``
    where it cannot build."""
    import torch
    from torch.utils.cpp_extension import load_inline

    try:
        ext = load_inline(
            "lorastar_bench_fma", cpp_sources=_FMA_SRC, functions=["fma_loop"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - no toolchain
        return None
    ext.fma_loop(1000)
    iters, best = 1 << 20, 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        ext.fma_loop(iters)
        dt = time.perf_counter() - t0
        best = max(best, iters * 12 * 16 * 2 * torch.get_num_threads() / dt / 1e9)
    return best


def memory_read_gbs(mib: int = 512, reps: int = 5) -> float:
    """Sustained memory read bandwidth (GB/s) at the torch thread count: ``sum`` of a ``mib`` MiB
    fp32 tensor (far past the caches), best of ``reps``."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4)
    x.sum()
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def machine_line(gemm_roof: float | None = None) -> str:
    """The machine's measured fp32 FMA peak and memory read bandwidth beside the fp32 GEMM rates it
    reaches on SmolLM2's 576 x 1536 projection at 1 / 20 / 64 / 256 rows (best of torch and oneDNN),
    and what the bandwidth allows a one-request decode that streams SmolLM2's 540 MB of fp32 weights."""
    peak = fma_peak_gflops()
    bw = memory_read_gbs()
    rates = {r: gemm_gflops(seconds=0.5, rows=r) for r in (1, 20, 64)}
    rates[256] = gemm_roof if gemm_roof is not None else gemm_gflops(seconds=0.5)
    peak_s = f"{peak:.0f} GFLOP/s" if peak is not None else "n/a (no C++ toolchain)"
    gemm = " / ".join(f"{v:.0f}" for v in rates.values())
    share = " / ".join(f"{v / peak:.0%}" for v in rates.values()) if peak else ""
    return (
        f"Machine (measured now): fp32 FMA peak {peak_s}, memory read {bw:.1f} GB/s; fp32 GEMM at 1 / 20 / 64 / 256 "
        f"rows {gemm} GFLOP/s"
        + (f" ({share} of the FMA peak)" if share else "")
        + f"; one request streaming 540 MB of fp32 weights per token: at most {bw / 0.54:.0f} tok/s at that bandwidth."
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: Any, port: int, output: Callable[[], str], timeout: float = 600.0) -> None:
    """Poll ``http://127.0.0.1:{port}/health`` until it answers 200; if ``proc`` exits first, raise
    with the tail of ``output()`` (the server's log)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{output()[-3000:]}")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy")
