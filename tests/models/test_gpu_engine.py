"""The engine on CUDA (Triton paged attention + LoRA kernels) against HF / PEFT on the same GPU."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPT = [11, 250, 3071, 9, 40000, 17, 17, 600]


def _hf_greedy(hf, prompt: list[int], new: int, **kw: object) -> list[int]:  # noqa: ANN001
    """HF's greedy continuation of ``prompt``, exactly ``new`` tokens; ``kw``: more ``generate`` args."""
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **kw)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "llama-mha-llama3"])
def test_cuda_fp32_matches_hf(tiny_model_dir, name: str) -> None:
    from tests.models.test_llama_vs_hf import mixed_prompts

    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = mixed_prompts(11, [1, 3, 16, 17, 31, 64, 150, 200])
    # Small token budget: prefill chunks mix with decodes in one forward (both Triton kernels).
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=96)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == ref, f"prompt of {len(p)} tokens"
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_cuda_bf16_matches_hf_until_a_near_tie(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on CUDA (the one-launch RMSNorm and SiLU-and-mul, Triton attention, CUDA graphs)
    follows HF's bf16 greedy tokens; where they part, HF's own top two were within bf16's noise.
    A prompt's logits are no further from HF's than those of the same model with torch's
    norm and activation."""
    from tests.models.test_llama_vs_hf import mixed_prompts

    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    prompts = mixed_prompts(12, [1, 5, 16, 33, 64, 150])
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        want = ref.sequences[0, len(p) :].tolist()
        got = o.outputs[0].token_ids
        diverged = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        if diverged:
            top = ref.logits[diverged[0]][0].float().log_softmax(-1).topk(2).values
            assert (top[0] - top[1]).item() < 0.25, f"prompt of {len(p)} tokens parted at a clear choice"
    llm.engine.check_invariants()
    from lorastar.layers import activation, norm
    from tests.conftest import prefill_logits

    with torch.no_grad():
        want = hf(torch.tensor([prompts[-1]], device="cuda")).logits[0].float()  # [T, vocab]
    err = (prefill_logits(llm.engine.model, prompts[-1]).float() - want).abs().max().item()
    monkeypatch.setattr(norm, "HAS_TRITON", False)
    monkeypatch.setattr(activation, "HAS_TRITON", False)
    torch_err = (prefill_logits(llm.engine.model, prompts[-1]).float() - want).abs().max().item()
    assert err <= 2 * torch_err + 0.02, (err, torch_err)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "qwen3", "gemma3", "phi3"])
def test_cuda_mixed_lora_batch_matches_peft(tiny_model_dir, tmp_path: Path, name: str) -> None:
    """Prefill logits and greedy decodes of a batch mixing four adapters and the base equal PEFT's
    on the same GPU; decode steps take the shrink in the base GEMM (stacked slots), whose outputs
    are strided views into the rotary, q/k norms, activations and norms after them (Qwen2: the
    stacked bias; Phi-3: LoRA on the fused modules)."""
    from tests.adapters.test_lora_vs_peft import make_adapters, peft_reference

    base_dir = tiny_model_dir(name)
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths).cuda()
    llm = LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=256, max_loras=4, max_lora_rank=16)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    assert all(lora.stacked is not None for _, lora in llm.engine.lora_state.slots)
    order = [None, "a", "b", "c", "d", "a", None, "c", "b", "d"]
    prompts = [[7 + i] * (5 + 3 * i) for i in range(len(order))]
    eng = llm.engine
    for p, a in zip(prompts, order):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=1), adapter=a)
    out = eng.scheduler.schedule()
    logits = eng.runner.execute(out, eng._adapter_slots(out)).logits
    for row, (p, a) in enumerate(zip(prompts, order)):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p], device="cuda"), adapter_names=[a or "__base__"]).logits[
                0, -1
            ]
        torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for rid in list(eng.requests):
        eng.abort_request(rid)
    # Decode steps: the stacked shrink and one expand per linear; greedy tokens equal PEFT.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                            do_sample=False, pad_token_id=0, adapter_names=[a or "__base__"])[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == want, f"adapter {a}"


def test_cuda_bf16_and_fp8_kv_run(tiny_model_dir) -> None:
    """FP8 caches (computed scales, CUDA graphs) follow the bf16 cache until a near tie of the
    bf16 run; a random tiny model has many, so a raw agreement ratio would measure luck."""
    path = tiny_model_dir("llama-gqa")
    prompts = [[5 + i] * (10 + 7 * i) for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    bf16 = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=128).generate(prompts, sp)
    for kv in ("fp8", "fp8_e5m2"):
        llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=128)
        assert all(s != 1.0 for s in llm.engine.kv_scales[0])  # computed, not the unit default
        for base, got in zip(bf16, llm.generate(prompts, sp)):
            a, b = base.outputs[0], got.outputs[0]
            diverged = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y]
            if diverged:
                top = sorted((lp.logprob for lp in a.logprobs[diverged[0]].values()), reverse=True)
                assert top[0] - top[1] < 0.25, f"{kv}: diverged at a clear choice ({top[0] - top[1]:.3f})"


def test_cuda_sampling_controls_match_hf(tiny_model_dir) -> None:
    """The sampler's per-request controls on CUDA, in one batch with async scheduling: greedy
    decoding under ``allowed_token_ids``, ``logit_bias`` and ``repetition_penalty`` equal HF's
    ``generate`` with ``suppress_tokens``, ``sequence_bias`` and ``repetition_penalty`` on the same
    GPU; seeded draws stay inside the allowed set; a plain row beside them equals plain greedy."""
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(3)
    allowed = sorted(torch.randperm(vocab, generator=g)[:64].tolist())
    prompt = PROMPT
    hf_greedy = partial(_hf_greedy, hf, prompt, 12)
    want_plain = hf_greedy()
    want_allowed = hf_greedy(suppress_tokens=sorted(set(range(vocab)) - set(allowed)))
    # Banned: plain greedy's first picks; raised a little: random ids (a random model's logits are
    # close together, so a large raise would win every step and test nothing after the first).
    bias = {t: -100.0 for t in want_plain[:4]} | {
        int(i): 0.05 for i in torch.randperm(vocab, generator=g)[:32]
    }
    want_bias = hf_greedy(sequence_bias={(i,): b for i, b in bias.items()})
    want_penalty = hf_greedy(repetition_penalty=0.5)  # below one: seen tokens are favoured
    assert len({tuple(want_allowed), tuple(want_bias), tuple(want_penalty), tuple(want_plain)}) == 4

    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128)
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**base, allowed_token_ids=allowed),
        SamplingParams(**base, logit_bias=bias),
        SamplingParams(**base, repetition_penalty=0.5),
        SamplingParams(**base),
        SamplingParams(
            temperature=1.0, seed=7, n=8, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
        ),
    ]
    outs = llm.generate([prompt] * len(params), params)
    assert [o.outputs[0].token_ids for o in outs[:4]] == [want_allowed, want_bias, want_penalty, want_plain]
    assert all(set(c.token_ids) <= set(allowed) for c in outs[4].outputs)
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_cuda_thinking_budget_matches_hf_and_releases_the_hold(tiny_model_dir, device: str = "cuda") -> None:
    """``thinking_token_budget`` on CUDA with async scheduling (the default there), in one batch:
    greedy rows equal HF's greedy up to the budget, then the end tag, then HF's greedy continuation;
    a block the model closes itself is untouched; a plain row beside them equals plain greedy. No
    step runs one at a time: each launches while the one before is in flight."""
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompt = [11, 250, 3071, 9, 40000, 17, 17, 600]
    new = 12

    greedy = partial(_hf_greedy, hf)
    free = greedy(prompt, new)
    end = free[3]  # a token the model writes later stands for </think>: the budget brings it forward
    assert end not in free[:3], free

    def forced(prefix: list[int]) -> list[int]:
        return [*prefix, end, *greedy([*prompt, *prefix, end], new - len(prefix) - 1)]

    cases = [
        ({"reasoning_end_token_id": end, "thinking_token_budget": 0}, forced([])),
        ({"reasoning_end_token_id": end, "thinking_token_budget": 2}, forced(free[:2])),
        ({"reasoning_start_token_id": free[0], "reasoning_end_token_id": end, "thinking_token_budget": 1},
         forced(free[:2])),
        ({"reasoning_end_token_id": end, "thinking_token_budget": 1, "thinking_budget_message_ids": [free[6]]},
         forced([free[0], free[6]])),
        ({"reasoning_end_token_id": free[1], "thinking_token_budget": 4}, free),  # the model closes it
        ({}, free),
    ]  # fmt: skip
    llm = LLM(path, device=device, dtype="float32", num_kv_blocks=128)
    eng = llm.engine
    assert eng.async_scheduling
    for i, (kw, _) in enumerate(cases):
        eng.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, **kw), request_id=str(i)
        )
    holding, in_flight, got = [], [], {}
    while eng.has_unfinished():
        holding.append(eng._num_sync_requests)
        for o in eng.step():
            got[o.request_id] = list(o.outputs[0].token_ids)
        in_flight.append(eng._inflight is not None)
    assert [got[str(i)] for i in range(len(cases))] == [want for _, want in cases]
    assert not any(holding) and sum(in_flight) >= new - 1, (holding, in_flight)
    eng.check_invariants()
    assert eng._num_host_readers == 0 and llm.kv_cache_usage()["num_used_blocks"] == 0


def test_cuda_bad_words_match_hf(tiny_model_dir, device: str = "cuda") -> None:
    """``bad_words`` on CUDA with async scheduling: words of one and of two tokens taken from plain
    greedy's output (a two-token word holds the batch to one step at a time while its first token
    may come), tokenized as vLLM does, equal HF's ``generate(bad_words_ids=...)`` with the same
    ids; a plain row beside it equals plain greedy."""
    from transformers import AutoTokenizer

    from lorastar.engine.sampling import bad_words_token_ids

    path = tiny_model_dir("llama-gqa")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompt = PROMPT
    hf_greedy = partial(_hf_greedy, hf, prompt, 16)
    free = hf_greedy()
    words = [tok.decode(free[k : k + n]).strip() for k, n in ((1, 1), (4, 2), (9, 2))]
    words = [w for w in words if w]
    banned = bad_words_token_ids(lambda t: tok.encode(t, add_special_tokens=False), words)
    assert any(len(w) > 1 for w in banned), banned
    want = hf_greedy(bad_words_ids=banned)
    assert want != free
    llm = LLM(path, device=device, dtype="float32", num_kv_blocks=128)
    base = dict(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([prompt] * 2, [SamplingParams(**base, bad_words=words), SamplingParams(**base)])
    assert [o.outputs[0].token_ids for o in outs] == [want, free]
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
