"""Async scheduling (``EngineConfig.async_scheduling``): step N+1 is launched before step N's
tokens are read back. References are HF transformers and PEFT (greedy, token for token); seeded
sampling and everything HF cannot produce (stop strings, preemption, aborts) must equal the same
engine without async scheduling. Nothing may leak: no KV block, adapter slot or placeholder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.engine.sampling import RequestOutputKind
from tests.adapters.test_lora_vs_peft import make_adapters, peft_greedy, peft_reference
from tests.fuzzing import budget
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 12


@pytest.fixture(scope="module")
def base(tiny_model_dir):  # noqa: ANN001, ANN201
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(11, [1, 5, 16, 17, 40, 3, 33])
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    return path, prompts, refs


def _llm(path: str, async_scheduling: bool, **kw) -> LLM:  # noqa: ANN003
    kw = {"num_kv_blocks": 128, "max_model_len": 256, "max_num_batched_tokens": 64, **kw}
    return LLM(path, async_scheduling=async_scheduling, **kw)


def _clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_invariants()
    assert not eng.requests and not eng.has_unfinished()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
    assert eng._num_sync_requests == 0


def _outputs(outs) -> list[tuple[list[int], str | None, object]]:  # noqa: ANN001
    return [(c.token_ids, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def test_greedy_matches_hf_with_staggered_ends(base) -> None:  # noqa: ANN001
    """Requests end at different steps (max_tokens, a stop token id taken from HF's own output),
    so later steps run with placeholders of sequences that ended the step before."""
    path, prompts, refs = base
    llm = _llm(path, True)
    params = []
    for i, ref in enumerate(refs):
        p = SamplingParams(temperature=0, max_tokens=NEW - i, ignore_eos=True)
        if i % 3 == 1:  # a stop token that HF produces mid-way: ends there (the token is kept)
            p = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[ref[4]])
        params.append(p)
    outs = llm.generate(prompts, params)
    for i, (ref, o) in enumerate(zip(refs, outs)):
        c = o.outputs[0]
        if i % 3 == 1:
            stop = ref.index(ref[4]) + 1
            assert c.token_ids == ref[:stop] and c.finish_reason == "stop" and c.stop_reason == ref[4]
        else:
            assert c.token_ids == ref[: NEW - i] and c.finish_reason == "length"
    _clean(llm)


def test_steps_overlap_and_inputs_come_from_the_device(base, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The first call launches the prefill and hands back nothing; every later decode step takes
    its input ids from the previous step's sampled ids (the patch), not from the host."""
    path, prompts, refs = base
    llm = _llm(path, True)
    eng = llm.engine
    patches: list[object] = []
    execute = eng.runner.execute

    def spy(out, slots=None, patch=None, **kw):  # noqa: ANN001, ANN003, ANN202
        patches.append(patch)
        return execute(out, slots, patch, **kw)

    monkeypatch.setattr(eng.runner, "execute", spy)
    eng.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert eng.step() == [] and eng._inflight is not None  # prefill launched, its token in flight
    seq = next(iter(eng.requests.values())).sequences[0]
    assert seq.num_placeholders == 1 and seq.num_tokens == len(prompts[2]) + 1
    got: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            got = o.outputs[0].token_ids
    assert got == refs[2][:4]
    assert patches[0] is None and len(patches) == 4  # max_tokens=4: the 4th token ends it, unscheduled
    for p in patches[1:]:
        assert p is not None and p[1] == [0] and p[2] == [0]
    _clean(llm)


def test_seeded_sampling_and_stop_strings_equal_sync(base) -> None:  # noqa: ANN001
    path, prompts, _ = base
    llms = {mode: _llm(path, mode) for mode in (False, True)}
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=NEW, ignore_eos=True)
        for i in range(len(prompts))
    ]
    got = {mode: _outputs(llm.generate(prompts, params)) for mode, llm in llms.items()}
    assert got[True] == got[False]
    # Stop strings: found by the frontend after the core already launched the next step.
    text = llms[False].generate([prompts[4]], params[4])[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=104, max_tokens=NEW, ignore_eos=True,
                         stop=[stop])]  # fmt: skip
    outs = {mode: llm.generate([prompts[4]], sp)[0].outputs[0] for mode, llm in llms.items()}
    assert outs[True].text == outs[False].text and stop not in outs[True].text
    assert outs[True].finish_reason == "stop" and outs[True].token_ids == outs[False].token_ids
    for llm in llms.values():
        _clean(llm)


def test_streams_equal_final_outputs(base) -> None:  # noqa: ANN001
    path, prompts, refs = base
    llm = _llm(path, True)
    eng = llm.engine
    ids = [
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA, logprobs=2)).request_id
        for p in prompts
    ]  # fmt: skip
    toks: dict[str, list[int]] = {i: [] for i in ids}
    lps: dict[str, int] = {i: 0 for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.outputs[0].token_ids
            lps[o.request_id] += len(o.outputs[0].logprobs or [])
    for i, ref in zip(ids, refs):
        assert toks[i] == ref and lps[i] == NEW
    _clean(llm)


def test_preemption_and_prefix_cache(base) -> None:  # noqa: ANN001
    """A cache too small for the batch preempts sequences that hold placeholders; a second round
    of the same prompts takes the committed blocks from the prefix cache."""
    path, prompts, refs = base
    llm = _llm(path, True, num_kv_blocks=14, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    short = [p for p in prompts if len(p) <= 17]
    want = [r for p, r in zip(prompts, refs) if len(p) <= 17]
    outs = llm.generate(short, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.stats.num_preemptions > 0
    again = llm.generate(short, params)
    assert [o.outputs[0].token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0
    _clean(llm)


def test_penalties_keep_the_overlap_and_equal_sync(base) -> None:  # noqa: ANN001
    """Repetition, frequency and presence penalties count the previous step's token from the
    device (it is a placeholder on the host when the next step is sampled): outputs equal the
    synchronous engine's token for token, greedy and seeded, with penalties that make tokens
    repeat (so the pending token is often one the row already holds), and no step waits."""
    path, prompts, _ = base
    kw = {"max_tokens": 20, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, **kw),
        SamplingParams(temperature=0, frequency_penalty=-2.0, **kw),  # repeats: counts above 1
        SamplingParams(temperature=0, presence_penalty=0.9, **kw),
        SamplingParams(
            temperature=0.9, seed=5, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3, **kw
        ),  # fmt: skip
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=1.0, seed=7, repetition_penalty=0.7, presence_penalty=-1.0, **kw),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=0.3, **kw),
    ]
    sync, asy = _llm(path, False), _llm(path, True)
    want = _outputs(sync.generate(prompts, params))
    eng = asy.engine
    launch, pending_rows = eng.sampler.launch, []

    def recording(*a, pending=None, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        assert eng._num_sync_requests == 0
        pending_rows.append(len(pending.rows) if pending is not None else 0)
        return launch(*a, pending=pending, **k)

    eng.sampler.launch = recording
    assert _outputs(asy.generate(prompts, params)) == want
    assert sum(n > 0 for n in pending_rows) >= 15  # every decode step had rows with a pending token
    assert any(len(set(ids)) < len(ids) // 2 for ids, _, _ in want)
    _clean(sync)
    _clean(asy)


def test_n_samples_run_async_once_forked(base) -> None:  # noqa: ANN001
    """An n > 1 request makes steps run one at a time only until its samples fork (its first
    token): from then on they are n plain sequences and steps overlap again. Outputs equal the
    synchronous engine's (seeded sampling, greedy samples, with a penalty, beside plain requests)."""
    path, prompts, _ = base
    kw = {"max_tokens": 10, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.8, seed=3, n=3, **kw),
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=0, n=2, **kw),
        SamplingParams(temperature=1.0, seed=9, n=2, frequency_penalty=0.5, **kw),
        SamplingParams(temperature=0.7, n=4, **{**kw, "max_tokens": 6}),  # unseeded: shapes only
    ]
    sync, asy = _llm(path, False), _llm(path, True)
    want = _outputs(sync.generate(prompts[:5], params))
    eng = asy.engine
    launch, overlapped = eng._launch, []

    def counting(out, prev, *rest):  # noqa: ANN001, ANN002, ANN202
        eng.check_invariants()
        forked = [s.seq for s in out.scheduled if s.seq.request.params.n > 1]
        overlapped.append(bool(forked) and prev is not None)
        return launch(out, prev, *rest)

    eng._launch = counting  # type: ignore[method-assign]
    got = _outputs(asy.generate(prompts[:5], params))
    assert got[:-4] == want[:-4]  # all but the unseeded request's samples
    assert [(len(t), r) for t, r, _ in got[-4:]] == [(6, "length")] * 4
    assert sum(overlapped) >= 7  # the forked samples' decode steps
    _clean(sync)
    _clean(asy)


def test_requests_that_need_sync_steps_mix_in(base) -> None:  # noqa: ANN001
    """Beam search, prompt logprobs and an unforked n > 1 request make steps run one at a time;
    penalties do not; the others around them keep HF's tokens, and the counter of such requests
    returns to zero."""
    path, prompts, refs = base
    sync, asy = _llm(path, False), _llm(path, True)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    special = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=5, ignore_eos=True),
        SamplingParams(n=2, use_beam_search=True, max_tokens=4, ignore_eos=True),
    ]
    plist = [greedy, special[0], greedy, special[1], greedy, special[2], greedy]
    got = {m: _outputs(llm.generate(prompts, plist)) for m, llm in ((False, sync), (True, asy))}
    assert got[True] == got[False]
    outs = asy.generate(prompts, plist)
    for i in (0, 2, 4, 6):
        assert outs[i].outputs[0].token_ids == refs[i]
    _clean(sync)
    _clean(asy)


def _host_reader_params(tokenizer, refs: list[list[int]]) -> list[SamplingParams]:  # noqa: ANN001
    """Seven requests for seven prompts: plain greedy first and last, between them rows whose
    sampling reads the output on the host (a regex that ends on EOS, guided_choice, a bad word of
    two tokens from row 3's own greedy output, a thinking budget of one token closed by row 4's
    fourth greedy token) and a penalty (read on the device). ``refs``: greedy outputs."""
    from lorastar.engine.sampling import bad_words_token_ids

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    words = [  # the first two-token piece of row 3's output that tokenizes back to itself
        next(w for k in range(1, NEW - 2) if (w := tokenizer.decode(refs[3][k : k + 2]).strip())
             and refs[3][k : k + 2] in bad_words_token_ids(enc, [w]))
    ]  # fmt: skip
    greedy = {"temperature": 0, "max_tokens": NEW, "ignore_eos": True}
    return [
        SamplingParams(**greedy),
        SamplingParams(temperature=0, max_tokens=NEW, guided_regex="(yes|no), [0-9]{1,2}!"),  # ends on EOS
        SamplingParams(**greedy, guided_choice=["black cat", "white cat", "a ginger cat called Tom"]),
        SamplingParams(**greedy, bad_words=words),
        SamplingParams(**greedy, reasoning_end_token_id=refs[4][3], thinking_token_budget=1),
        SamplingParams(**greedy, repetition_penalty=1.3),
        SamplingParams(**greedy),
    ]


def test_rows_that_read_their_output_on_the_host_keep_the_overlap(base) -> None:  # noqa: ANN001
    """A grammar, guided_choice, a bad word of several tokens and a thinking budget read the
    output on the host: with async scheduling their steps still launch while the step before is
    in flight, which completes between the forward and sampling (no step runs one at a time);
    every output equals the engine's without async scheduling, plain rows beside them HF's, and
    a sequence that ends (a grammar's EOS; one of two samples on a stop token) while its next step
    is launched leaves nothing behind: no token is added to it after its end."""
    path, prompts, refs = base
    sync, asy = _llm(path, False), _llm(path, True)
    eng = asy.engine
    params = _host_reader_params(eng.tokenizer, refs)
    # Two samples, the first ending early on a stop token its sibling never draws.
    two = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=NEW, ignore_eos=True)
    a, b = (c.token_ids for c in sync.generate([prompts[2]], two)[0].outputs)
    stop = next(t for t in a[2:] if t not in b)
    params.append(
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop])
    )
    prompts = [*prompts, prompts[2]]
    want = _outputs(sync.generate(prompts, params))
    assert len(want[-2][0]) < NEW and len(want[-1][0]) == NEW  # the samples end apart
    launch, early, holding = eng._launch, [], []

    def watching(out, prev, complete_into=None):  # noqa: ANN001, ANN202
        holding.append(eng._num_sync_requests)
        early.append(prev is not None and complete_into is not None)
        return launch(out, prev, complete_into)

    eng._launch = watching  # type: ignore[method-assign]
    got = _outputs(asy.generate(prompts, params))
    assert got == want
    assert [got[i][0] for i in (0, 6)] == [refs[0], refs[6]]
    assert got[1][1] == "stop" and len(got[1][0]) < NEW  # the grammar's answer ended early
    assert got[3][0] != refs[3]  # the bad word bit
    assert got[4][0][:2] == [refs[4][0], refs[4][3]]  # the budget closed the block after one token
    assert sum(early) >= NEW - 2 and not any(holding)  # every decode step overlapped
    _clean(asy)
    assert eng._num_host_readers == 0
    _clean(sync)


def test_abort_while_in_flight(base) -> None:  # noqa: ANN001
    path, prompts, refs = base
    llm = _llm(path, True)
    eng = llm.engine
    reqs = [
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)) for p in prompts
    ]
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    gone = reqs[1].request_id
    final = eng.abort_request(gone)
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    assert all(s.num_placeholders == 0 for s in reqs[1].sequences)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != gone
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    for r, ref in zip(reqs, refs):
        if r.request_id != gone:
            assert done[r.request_id] == ref
    _clean(llm)


def test_adapters_match_peft(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    base_dir = tiny_model_dir("llama-gqa")
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths)
    llm = LLM(base_dir, num_kv_blocks=256, max_loras=2, max_lora_rank=16, async_scheduling=True)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    rng = random.Random(5)
    order = [None, "a", "b", "c", "d", "a", None, "c"]  # 4 adapters, 2 slots: some wait their turn
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 30))] for _ in order]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 8), f"adapter {a}"
    _clean(llm)
    assert all(a.in_flight == 0 for a in llm.list_adapters())


async def test_core_process_with_async_scheduling_equals_the_in_process_engine() -> None:
    """The core in its own process (where async scheduling runs behind the server): SmolLM2's
    greedy tokens and a stop string found by the frontend, equal to the synchronous engine."""
    import asyncio

    from lorastar.config import EngineConfig
    from lorastar.engine.core_client import AsyncCoreClient

    opts = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=8)
    ref = LLM(**opts)
    client = AsyncCoreClient(EngineConfig(async_scheduling=True, **opts))
    try:
        prompts = ["The capital of France is", "One, two, three,", "def fib(n):"]
        for sp in (
            SamplingParams(temperature=0.0, max_tokens=16),
            SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
        ):
            want = [o.outputs[0] for o in ref.generate(prompts, sp)]

            async def final(prompt: str, sp: SamplingParams = sp):  # noqa: ANN202
                return [o async for o in client.generate(prompt, sp)][-1].outputs[0]

            got = await asyncio.gather(*(final(p) for p in prompts))
            assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [
                (o.text, o.token_ids, o.finish_reason) for o in want
            ]
    finally:
        await client.shutdown(drain_timeout=0)


def test_default_follows_the_device(base) -> None:  # noqa: ANN001
    """``async_scheduling=None`` (the default) is off on a CPU, where nothing overlaps; an
    explicit value wins; anything but a bool or None is refused by name."""
    from lorastar.config import EngineConfig

    path, _, _ = base
    assert LLM(path, num_kv_blocks=16).engine.async_scheduling is False
    assert _llm(path, True).engine.async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_default_is_async_on_cuda(base) -> None:  # noqa: ANN001
    """On CUDA the default engine schedules asynchronously, and its greedy tokens equal HF's."""
    path, prompts, refs = base
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128)
    assert llm.engine.async_scheduling is True
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    _clean(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_launch_never_waits_for_the_device(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:  # noqa: ANN001
    """On a GPU: greedy tokens equal HF's (fp32), and launching a decode step while the previous
    one is in flight queues no operation that synchronizes with the device (torch's sync debug
    mode raises on a blocking copy, ``.item()``, ``.tolist()``, a stream synchronize), so the
    host's scheduling and output work overlaps the forward. Graphs are captured in a first round
    (capturing synchronizes); the checked round replays them."""
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = mixed_prompts(11, [1, 3, 16, 17, 31, 64])
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=96,
              async_scheduling=True, enforce_eager=eager)  # fmt: skip
    sp = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2 if i % 2 else None)
          for i in range(len(prompts))]  # fmt: skip
    outs = _generate_strictly(llm, monkeypatch, prompts, sp)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == ref, f"prompt of {len(p)} tokens"
        if o.outputs[0].logprobs is not None:  # read back with the ids: the sampled token's, rank 1
            assert all(d[t].rank == 1 and len(d) == 2 for d, t in zip(o.outputs[0].logprobs, ref))
    _clean(llm)


def _generate_strictly(
    llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list,
    sp: list,
    adapter: list | None = None,
    mixed: list[int] | None = None,
) -> list:
    """Generate twice; in the second round every decode step with a step in flight (and, with
    graphs, a captured graph) is launched under torch's sync debug mode "error". With ``mixed``
    (a list), steps that run prefill chunks (eager: never a graph) are checked too, and the number
    of prefill tokens of each is appended to it."""
    eng = llm.engine
    launch = eng._launch
    checked: list[int] = []
    checked_round = False

    def strict(out, prev, *rest):  # noqa: ANN001, ANN002, ANN202
        graphs = eng.runner.graphs
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens != 1)
        if (
            not checked_round
            or prev is None
            or (prefill and mixed is None)
            or (
                not prefill
                and graphs is not None
                # a step with adapters replays the graph captured with them (key (size, True))
                and (graphs.padded_size(len(out.scheduled)), eng._adapter_slots(out) is not None)
                not in graphs.graphs
            )
        ):  # a prefill (unless asked), or a batch size without a graph yet: its capture synchronizes
            return launch(out, prev, *rest)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(out, prev, *rest)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(out.scheduled))
            if prefill and mixed is not None:
                mixed.append(prefill)

    monkeypatch.setattr(eng, "_launch", strict)
    llm.generate(prompts, sp, adapter=adapter)
    checked_round = True
    outs = llm.generate(prompts, sp, adapter=adapter)
    assert len(checked) >= 10
    return outs


@pytest.mark.gpu
def test_cuda_rows_that_read_the_host_sample_without_waiting(base, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """On a GPU: rows whose sampling reads the output on the host (a grammar, guided_choice, a bad
    word of two tokens, a thinking budget) in an async batch; sampling a step launched with a step
    in flight queues nothing that synchronizes (their masks go through pinned memory), and every
    output equals the engine's without async scheduling, the plain rows HF's (fp32)."""
    path, prompts, refs = base
    kw = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 256}
    sync, llm = LLM(path, async_scheduling=False, **kw), LLM(path, async_scheduling=True, **kw)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    refs = [hf_greedy(hf, p, NEW) for p in prompts]  # this GPU's greedy: the words and tags come from it
    params = _host_reader_params(llm.tokenizer, refs)
    want = _outputs(sync.generate(prompts, params))
    eng = llm.engine
    launch, checked, strict_round = eng.sampler.launch, [], False

    def strict(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not (strict_round and kwargs.get("no_sync") and eng._num_host_readers):
            return launch(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(args[1]))

    monkeypatch.setattr(eng.sampler, "launch", strict)
    assert _outputs(llm.generate(prompts, params)) == want  # captures graphs, compiles the grammars
    strict_round = True
    got = _outputs(llm.generate(prompts, params))
    assert got == want and [got[0][0], got[6][0]] == [refs[0], refs[6]]
    assert len(checked) >= NEW - 2
    _clean(llm)
    _clean(sync)


@pytest.mark.gpu
def test_cuda_penalties_never_wait_and_equal_sync(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """On a GPU: penalties read the pending token on the device; launching a step with penalized
    rows queues nothing that synchronizes, and outputs equal the synchronous engine's."""
    path = tiny_model_dir("llama-gqa")
    prompts = mixed_prompts(13, [1, 3, 16, 17, 31, 64])
    sp = [SamplingParams(temperature=[0, 0.8][i % 2], seed=i, max_tokens=16, ignore_eos=True,
                         repetition_penalty=[1.3, 1.0, 0.8][i % 3], frequency_penalty=[0.0, 0.5, -1.0][i % 3],
                         presence_penalty=[0.4, 0.0][i % 2]) for i in range(len(prompts))]  # fmt: skip
    opts = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 96}
    want = _outputs(LLM(path, async_scheduling=False, **opts).generate(prompts, sp))
    llm = LLM(path, async_scheduling=True, **opts)
    assert _outputs(_generate_strictly(llm, monkeypatch, prompts, sp)) == want
    _clean(llm)


@pytest.mark.gpu
def test_cuda_truncated_sampling_never_waits_and_equals_sync(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """On a GPU: rows under top-p alone (OpenAI's usual sampling), top-k with top-p, and min-p,
    with EOS banned until min_tokens (with allowed_token_ids too: the rows checked for masks that
    leave nothing), allowed_token_ids or a logit_bias beside them, launch
    without waiting for the device (top-p alone sorts the whole row there: the window search read
    back which rows needed more, which waits for the step in flight; the bans and the allowed-ids
    mask filled from a Python number, which copies it from pageable memory), and the seeded rows
    draw the synchronous engine's tokens; an unseeded row among them only has to run."""
    path = tiny_model_dir("llama-gqa")
    prompts = mixed_prompts(17, [1, 3, 16, 17, 31, 64])
    truncation = [{"top_p": 0.9}, {"top_k": 20, "top_p": 0.95}, {"min_p": 0.1}, {"top_p": 0.5}]
    ban = {"ignore_eos": False, "min_tokens": 16}
    extra = [
        ban,
        {**ban, "allowed_token_ids": list(range(3, 600))},
        {"ignore_eos": True, "logit_bias": {5: 3.0}},
    ]
    sp = [SamplingParams(temperature=[0.8, 1.0, 1.3][i % 3], seed=None if i == 5 else i, max_tokens=16,
                         **truncation[i % 4], **extra[i % 3]) for i in range(len(prompts))]  # fmt: skip
    opts = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 96}
    want = _outputs(LLM(path, async_scheduling=False, **opts).generate(prompts, sp))
    llm = LLM(path, async_scheduling=True, **opts)
    got = _outputs(_generate_strictly(llm, monkeypatch, prompts, sp))
    assert [g for i, g in enumerate(got) if i != 5] == [w for i, w in enumerate(want) if i != 5]
    assert len(got[5][0]) == 16
    _clean(llm)


@pytest.mark.gpu
def test_cuda_adapter_batches_never_wait_and_match_peft(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """On a GPU: decode steps of a batch mixing four adapters and the base launch without waiting
    for the device (the slot runs reach the graph's buffer through pinned memory), and the greedy
    tokens equal PEFT's on the same GPU. Uploading an adapter into a slot (a swap, which may come
    with a step in flight) does not wait either."""
    base_dir = tiny_model_dir("llama-gqa")
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths).cuda()
    llm = LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=256, max_loras=4, max_lora_rank=16,
              async_scheduling=True)  # fmt: skip
    for n, p in paths.items():
        llm.load_adapter(n, p)
    order = [None, "a", "b", "c", "d", "a", None, "c"]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 30))] for _ in order]
    sp = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(order)
    outs = _generate_strictly(llm, monkeypatch, prompts, sp, adapter=order)
    for p, a, o in zip(prompts, order, outs):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                            do_sample=False, pad_token_id=0, adapter_names=[a or "__base__"])[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == want, f"adapter {a}"
    entry = llm.engine.registry.acquire("b")
    assert entry.slot is not None and entry.weights is not None
    torch.cuda.set_sync_debug_mode("error")
    try:  # the same weights into the slot they hold: the registry's record stays true
        llm.engine.lora_state.load_slot(entry.slot, entry.content_hash, entry.weights.weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    llm.engine.registry.release(entry)
    again = llm.generate(prompts[2:3], sp[0], adapter="b")[0].outputs[0].token_ids
    assert again == outs[2].outputs[0].token_ids
    _clean(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_mixed_prefill_steps_never_wait_and_match_peft(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:  # noqa: ANN001
    """On a GPU: steps that run prefill chunks beside decodes (the prompts outnumber a 24-token
    budget, so chunks of the later ones share steps with the earlier ones' decodes), with two
    adapters and the base among the rows and prefix caching off (the checked round prefills
    again), launch without waiting for the device; greedy tokens equal PEFT's on the same GPU."""
    base_dir = tiny_model_dir("llama-gqa")
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths).cuda()
    llm = LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=256, max_loras=4, max_lora_rank=16,
              max_num_batched_tokens=24, enable_prefix_caching=False, async_scheduling=True,
              enforce_eager=eager)  # fmt: skip
    for n in ("a", "c"):
        llm.load_adapter(n, paths[n])
    order = [None, "a", "c", None, "a", "c", "a", None, "c", "a"]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.choice([1, 5, 17, 30, 45]))] for _ in order]
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(order)
    mixed: list[int] = []
    outs = _generate_strictly(llm, monkeypatch, prompts, sp, adapter=order, mixed=mixed)
    assert len(mixed) >= 5 and max(mixed) > 8, mixed  # several steps of real chunks were checked
    for p, a, o in zip(prompts, order, outs):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                            do_sample=False, pad_token_id=0, adapter_names=[a or "__base__"])[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == want, f"adapter {a}, prompt of {len(p)} tokens"
    _clean(llm)


@pytest.fixture(scope="module", params=["llama-gqa", "mistral-window"])
def fuzz_setup(tiny_model_dir, request):  # noqa: ANN001, ANN201
    """Also on a sliding-window model: blocks behind the window are freed while tokens are in flight."""
    path = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 10 blocks of 4 tokens: two or three running requests fill it, so sequences are preempted
    # with their next token in flight.
    llm = _llm(path, True, num_kv_blocks=10, block_size=4, max_num_batched_tokens=32)
    return llm, hf, {}


@budget(25)
@given(
    reqs=st.lists(
        st.tuples(
            st.lists(st.integers(3, 49151), min_size=1, max_size=24),  # prompt
            st.integers(1, 10),  # max_tokens
            st.integers(0, 5),  # step it arrives at
            st.one_of(st.none(), st.integers(0, 12)),  # step it is aborted at
            st.one_of(st.none(), st.integers(0, 9)),  # a stop token: HF's token at this index
            st.booleans(),  # reads its output on the host (a thinking budget that never binds)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_random_workloads_match_hf_and_leak_nothing(fuzz_setup, reqs) -> None:  # noqa: ANN001
    """Arrivals, aborts, stop tokens and preemption at random steps, with requests whose sampling
    reads the output on the host among them (their step in flight completes inside the next
    launch): every request that is not aborted ends exactly as HF's greedy continuation (cut at its
    stop token), an aborted one holds a prefix of it, and the engine is left with no request,
    block or placeholder."""
    llm, hf, refs = fuzz_setup
    eng = llm.engine
    for p, *_ in reqs:
        if tuple(p) not in refs:
            refs[tuple(p)] = hf_greedy(hf, p, 10)
    ids: dict[int, str] = {}
    got: dict[str, tuple[list[int], str | None]] = {}
    step = 0
    while len(ids) < len(reqs) or eng.has_unfinished():
        for i, (p, n, arrive, _, stop, host) in enumerate(reqs):
            if arrive == step:
                stops = [refs[tuple(p)][stop]] if stop is not None and stop < n else None
                budget_kw = {"reasoning_end_token_id": 1, "thinking_token_budget": 1000} if host else {}
                sp = SamplingParams(
                    temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=stops, **budget_kw
                )
                ids[i] = eng.add_request(p, sp).request_id
        for i, (*_, abort, _, _) in enumerate(reqs):
            if abort == step and i in ids and (out := eng.abort_request(ids[i])) is not None:
                got[out.request_id] = (out.outputs[0].token_ids, "abort")
        for out in eng.step():
            if out.finished:
                got[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        eng.check_invariants()
        step += 1
        assert step < 500
    for i, (p, n, _, _, stop, _) in enumerate(reqs):
        ref = refs[tuple(p)][:n]
        if stop is not None and stop < n:
            ref = ref[: ref.index(ref[stop]) + 1]
        toks, reason = got[ids[i]]
        if reason == "abort":
            assert toks == ref[: len(toks)]
        else:
            assert toks == ref and reason == ("stop" if stop is not None and stop < n else "length")
    _clean(llm)


def test_context_limit_ends_without_an_extra_step(base) -> None:  # noqa: ANN001
    """A sequence whose pending token reaches max_model_len ends with it: it is not scheduled
    again (no step computes a position past the limit) and keeps HF's tokens."""
    path, _, _ = base
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = _llm(path, True, max_model_len=40)
    prompt = mixed_prompts(3, [37])[0]
    scheduled_lens: list[int] = []
    execute = llm.engine.runner.execute

    def spy(out, slots=None, patch=None, **kw):  # noqa: ANN001, ANN003, ANN202
        scheduled_lens.extend(s.start + s.num_new_tokens for s in out.scheduled)
        return execute(out, slots, patch, **kw)

    llm.engine.runner.execute = spy  # type: ignore[method-assign]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, prompt, 3) and out.finish_reason == "length"
    assert max(scheduled_lens) == 39  # the 40th token is sampled at position 38 and never computed
    _clean(llm)
