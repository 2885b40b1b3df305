"""The engine's running / waiting gauges count an ``n > 1`` request's samples as vLLM counts them:
vLLM adds ``n`` child requests to its core, so ``vllm:num_requests_running`` / ``_waiting`` (what
gateways route on) show ``n``. They showed 1, so a replica busy with RL rollouts at ``n = 8``
looked eight times idler than it was."""

from __future__ import annotations

from pathlib import Path

from lorastar import LLM, SamplingParams
from tests.conftest import make_peft_adapter


def test_running_and_waiting_count_each_sample(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama-gqa")
    llm = LLM(base, num_kv_blocks=128, max_model_len=128, max_num_seqs=16)
    eng = llm.engine
    llm.load_adapter("a", make_peft_adapter(base, tmp_path / "a", 1))
    long = {"temperature": 1.0, "seed": 3, "max_tokens": 12, "ignore_eos": True}
    eng.add_request([5, 6, 7, 8], SamplingParams(n=4, **long), adapter="a")
    eng.add_request([9, 10, 11], SamplingParams(n=1, **long))
    eng.add_request([12, 13, 14], SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=6))
    s = eng.stats()
    assert (s.num_waiting, s.num_running) == (4 + 1 + 1, 0)  # a beam search starts as one beam
    assert s.adapters == {"a": {"running": 0, "waiting": 4}}
    for _ in range(3):
        eng.step()
    s = eng.stats()
    assert (s.num_waiting, s.num_running) == (0, 4 + 1 + 3)
    assert s.adapters == {"a": {"running": 4, "waiting": 0}}
    while eng.has_unfinished():
        eng.step()
    s = eng.stats()
    assert (s.num_waiting, s.num_running) == (0, 0) and s.adapters == {}
