"""Speculative decoding on CUDA: drafted steps run eagerly through the Triton paged attention's
multi-token path and the LoRA kernels, plain decode steps of the same engine replay CUDA graphs;
greedy outputs equal transformers' on the same GPU (fp32), with an adapter PEFT's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import SamplingParams
from lorastar.engine import engine as engine_mod
from tests.engine.test_spec_decode import _drained, _llm, _oracle
from tests.models.test_llama_vs_hf import mixed_prompts

pytestmark = pytest.mark.gpu


def _greedy(hf, prompt: list[int], new: int) -> list[int]:  # noqa: ANN001
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("with_adapter", [False, True])
def test_cuda_drafts_equal_hf(
    tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch, with_adapter: bool
) -> None:  # noqa: ANN001
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from tests.conftest import make_peft_adapter

    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = None
    if with_adapter:
        from peft import PeftModel

        adapter = make_peft_adapter(
            path, tmp_path / "a", seed=3, r=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")
        )
        hf = PeftModel.from_pretrained(hf, adapter)
    hf = hf.cuda().eval()
    prompts = mixed_prompts(21, [1, 16, 33, 150])
    refs = {tuple(p): _greedy(hf, p, 24) for p in prompts}
    monkeypatch.setattr(engine_mod, "propose_ngram", _oracle(refs, 3))
    llm = _llm(path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=96)
    if adapter is not None:
        llm.load_adapter("a", adapter)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        adapter="a" if adapter is not None else None,
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == refs[tuple(p)], f"prompt of {len(p)} tokens"
    st = llm.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert not llm.engine.async_scheduling  # off with drafting, though CUDA's default is on
    _drained(llm)
