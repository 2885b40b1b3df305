"""Adapter hot-loading under concurrency and failure: a load racing an unload of its name, and an
adapter folder rewritten in place while the adapter stays registered (vLLM copies an adapter's
tensors at load; what is served must not change until the adapter is loaded again)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_support import engine_config

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    from lorastar import LLM

    yield LLM(config=engine_config(tiny_model_dir, num_kv_blocks=64, max_loras=1, max_cpu_loras=4))


def _greedy(llm: Any, adapter: str) -> list[int]:
    from lorastar import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return list(llm.generate(["hello world"], sp, adapter=adapter)[0].outputs[0].token_ids)


def test_an_unload_coming_in_right_after_the_register_does_not_break_the_load(
    llm: Any, adapter_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: the load's reply was read from the registry after the engine lock was let go, so an
    unload of the name in between made ``load_adapter`` raise StopIteration (AsyncLLM: the awaiting
    task hung forever, and the HTTP route with it, holding the name's lock)."""
    eng = llm.engine
    real_list = eng.registry.list
    raced: list[bool] = []

    def unload_if_it_can() -> None:
        # The racing unload, when the engine lock lets it in before the load has answered.
        if eng.lock.acquire(blocking=False):
            try:
                eng.unload_adapter("racy")
                raced.append(True)
            finally:
                eng.lock.release()

    def listing() -> Any:
        if not raced and threading.current_thread() is threading.main_thread():
            t = threading.Thread(target=unload_if_it_can)
            t.start()
            t.join()
            raced.append(False)
        return real_list()

    monkeypatch.setattr(eng.registry, "list", listing)
    info = llm.load_adapter("racy", str(adapter_root / "alpha"))
    monkeypatch.undo()
    assert info.name == "racy" and raced == [False]
    llm.unload_adapter("racy")  # the unload, after the load
    assert "racy" not in {a.name for a in llm.list_adapters()}
    eng.check_invariants()
    assert llm.load_adapter("racy", str(adapter_root / "alpha")).name == "racy"
    llm.unload_adapter("racy")


def test_a_weights_file_rewritten_in_place_changes_nothing_until_reloaded(
    llm: Any, adapter_root: Path, tmp_path: Path
) -> None:
    """Was: float32 A tensors stayed views of the safetensors memory map, so copying another
    adapter's file over the folder (``cp``: same inode) gave the registered adapter the new A with
    its old B under its old hash: a mix of two adapters once its slot was uploaded again."""
    import torch

    folder = tmp_path / "inplace"
    shutil.copytree(adapter_root / "alpha", folder)
    llm.load_adapter("inplace", str(folder))
    llm.load_adapter("other", str(adapter_root / "beta"))
    entry = llm.engine.registry._names["inplace"]
    before = {k: (a.clone(), b.clone()) for k, (a, b) in entry.weights.weights.items()}
    want = _greedy(llm, "inplace")
    assert _greedy(llm, "other") != want  # max_loras=1: "inplace" lost its slot
    shutil.copyfile(adapter_root / "beta" / WEIGHTS, folder / WEIGHTS)  # same inode, new bytes
    for k, (a, b) in entry.weights.weights.items():
        assert torch.equal(a, before[k][0]) and torch.equal(b, before[k][1]), k
    assert _greedy(llm, "inplace") == want  # uploaded again from the weights it was loaded with
    # Loading it again (vLLM's load_inplace) serves the new file: beta's content.
    llm.load_adapter("inplace", str(folder))
    assert _greedy(llm, "inplace") == _greedy(llm, "other")
    for name in ("inplace", "other"):
        llm.unload_adapter(name)
    llm.engine.check_invariants()
