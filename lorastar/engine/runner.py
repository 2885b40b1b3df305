"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat token batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorastar.engine.cuda_graphs import DecodeGraphs
from lorastar.engine.input_batch import InputBatch, device_inputs
from lorastar.engine.prompt_logprobs import PromptTokenLogprobs, score_prompt_rows
from lorastar.engine.scheduler import ScheduledSeq, SchedulerOutput
from lorastar.forward_context import ForwardContext, LoRAMetadata, lora_ranges, slot_runs, to_device
from lorastar.layers.lora import LoRADeviceState
from lorastar.models.llama import LlamaForCausalLM


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass
class ModelRunnerOutput:
    """One step's results: fp32 ``logits [num_sampling, vocab]`` (one row per scheduled sequence
    that samples this step, in schedule order; ``1 + num_drafts`` rows for a drafted one) and, for sequences that asked for prompt logprobs,
    ``{seq_id: (first position, one entry per scored prompt position)}``."""

    logits: torch.Tensor
    prompt_logprobs: dict[int, tuple[int, list[PromptTokenLogprobs]]] = field(default_factory=dict)
    # {seq_id: {position: [hidden] row}} for prompt positions that end a KV block (kept with the
    # block's prompt logprobs so a later prefix-cache hit can score the position after it).
    prompt_hidden: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    # {seq_id: [hidden]} the last prompt token's final hidden state, for embedding requests
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)


# Async scheduling: input ids still on the device, ``(sampled ids [R], their rows, the schedule
# index of each sequence whose last input token is one of them)``.
InputPatch = tuple[torch.Tensor, list[int], list[int]]


def patch_input_ids(ids: torch.Tensor, last_row: list[int], patch: InputPatch) -> None:
    """``ids[last_row[i]] = tokens[r]`` for each ``(r, i)`` of ``patch``: a placeholder input id
    replaced by the previous step's sampled id without reading it back to the host."""
    tokens, src, sched = patch
    dst = to_device([last_row[i] for i in sched], ids.device, torch.int64)
    ids.index_copy_(0, dst, tokens[to_device(src, tokens.device, torch.int64)].to(ids.device))


def _prompt_span(s: ScheduledSeq) -> tuple[int, int]:
    """Prompt positions ``[first, last)`` whose logprobs this chunk's rows produce (row ``r`` of
    the chunk predicts position ``start + r + 1``); empty unless prompt logprobs were asked for."""
    seq = s.seq
    if seq.request.params.prompt_logprobs is None or seq.index != 0:
        return 0, 0
    first = s.start + 1
    return first, max(first, min(s.start + s.num_new_tokens + 1, seq.num_prompt_tokens))


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        spec: KVCacheSpec,
        device: torch.device,
        *,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
        lora_state: LoRADeviceState | None = None,
        cuda_graph_max_batch: int = 0,
        max_model_len: int = 0,
        native_cpu_kernels: bool = False,
    ) -> None:
        self.model = model
        self.native_cpu_kernels = native_cpu_kernels  # decode attention and LoRA's SGMV (fp32 / bf16)
        self.spec = spec
        self.device = device
        self.block_size = spec.block_size
        use_graphs = cuda_graph_max_batch > 0 and device.type == "cuda"
        # With CUDA graphs one extra block, owned by no sequence, takes the padding rows' K/V.
        num_blocks = spec.num_blocks + (1 if use_graphs else 0)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled: masked-out padding positions are still read, and NaN * 0 would poison SDPA.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=spec.dtype, device=device),
                torch.zeros(shape, dtype=spec.dtype, device=device),
            )
            for _ in range(spec.num_layers)
        ]
        self.k_scales = k_scales or [1.0] * spec.num_layers
        self.v_scales = v_scales or [1.0] * spec.num_layers
        self.lora_state = lora_state
        self.graphs: DecodeGraphs | None = None
        # Padding entries of the step's block tables: with graphs, the scratch block.
        self.batch = InputBatch(
            spec.block_size, max_model_len or 1, fill=spec.num_blocks if use_graphs else 0
        )
        if use_graphs:
            self.graphs = DecodeGraphs(
                model, self.kv_caches, self.k_scales, self.v_scales,
                block_size=spec.block_size, max_model_len=max_model_len, scratch_block=spec.num_blocks,
                max_batch=cuda_graph_max_batch, lora_state=lora_state,
            )  # fmt: skip

    # ---- step inputs ------------------------------------------------------------------------
    def prepare(
        self,
        out: SchedulerOutput,
        adapter_slot: dict[str, int] | None = None,
        patch: InputPatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Inputs of one eager forward: ``input_ids [T]``, ``positions [T]``, the context, and the
        flat row of each scheduled sequence's last token, in schedule order (its logits row)."""
        inputs = self.batch.prepare(out.scheduled, adapter_slot)
        input_ids, positions, md = device_inputs(
            inputs, block_size=self.block_size, device=self.device, native_cpu_decode=self.native_cpu_kernels
        )
        if patch is not None:
            patch_input_ids(input_ids, inputs.last_row, patch)
        lora = self._prepare_lora(inputs.lora_runs) if inputs.lora_runs is not None else None
        ctx = ForwardContext(
            attn=md, lora=lora, kv_caches=self.kv_caches, k_scales=self.k_scales, v_scales=self.v_scales,
        )  # fmt: skip
        return input_ids, positions, ctx, inputs.last_row

    def _prepare_lora(self, runs: list[tuple[int, int]]) -> LoRAMetadata | None:
        """The step's LoRA rows from ``(slot, rows)`` per sequence in row order (sorted by slot)."""
        state = self.lora_state
        if state is None:
            return None
        ranges = lora_ranges(runs)
        if not ranges:
            return None
        return LoRAMetadata(
            ranges=ranges,
            max_rank=max(state.ranks_host[s] for s, _, _ in ranges),
            max_rows=max(e - s for _, s, e in ranges),
            slot_runs=slot_runs(ranges, state.max_loras, self.device) if state.reads_slot_runs else None,
            active_slots=len(ranges),
            native=self.native_cpu_kernels,
        )

    # ---- execution --------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = to_device([c[0] for c in copies], self.device, torch.int64)
        dst = to_device([c[1] for c in copies], self.device, torch.int64)
        for k, v in self.kv_caches:
            for c in (k, v):
                c = c.view(torch.uint8) if c.element_size() == 1 else c  # no fp8 indexing on CPU
                c[dst] = c[src]

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        adapter_slot: dict[str, int] | None = None,
        patch: InputPatch | None = None,
        *,
        prompt_logprobs: bool = True,
        embeddings: bool = True,
    ) -> ModelRunnerOutput:
        """Run one step: the sampling rows' logits and any prompt logprobs it produced. ``patch``:
        input ids that are the previous step's sampled ids, still on the device.
        ``prompt_logprobs=False``: no scheduled request asks for them (the engine counts them), so
        the pass that looks is skipped; ``embeddings=False`` likewise for embedding requests."""
        self.copy_blocks(out.copies)
        wants = (
            [
                s.seq.request.params.prompt_logprobs is not None
                and s.seq.index == 0
                and s.start < s.seq.num_prompt_tokens
                for s in out.scheduled
            ]
            if prompt_logprobs
            else []
        )
        wants_prompt = any(wants)
        embeds = (
            [i for i, s in enumerate(out.scheduled) if s.samples and s.seq.request.params.embed]
            if embeddings
            else []
        )
        if (
            self.graphs is not None
            and not wants_prompt
            and not embeds
            and all(s.num_new_tokens == 1 for s in out.scheduled)
        ):
            logits = self._execute_graph(self.graphs, out, adapter_slot, patch)
            if logits is not None:
                return ModelRunnerOutput(logits)
        input_ids, positions, ctx, last_row = self.prepare(out, adapter_slot, patch)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        sampling = [last_row[i] for i, s in enumerate(out.scheduled) if s.samples]
        if any(s.num_drafts for s in out.scheduled):  # a drafted sequence: a row per draft, then its last
            sampling = [
                r
                for i, s in enumerate(out.scheduled)
                if s.samples
                for r in range(last_row[i] - s.num_drafts, last_row[i] + 1)
            ]
        if len(sampling) == hidden.shape[0] and sampling == list(range(len(sampling))):
            sample_hidden = hidden  # a decode step in schedule order: every row, as it is
        else:
            sample_hidden = hidden[to_device(sampling, self.device, torch.int64)]
        result = ModelRunnerOutput(self.model.compute_logits(sample_hidden).float())  # [B, vocab]
        if embeds:  # (a sampling row is the prompt's last token: embedding requests never decode)
            rows = hidden[to_device([last_row[i] for i in embeds], self.device, torch.int64)].float().cpu()
            for i, row in zip(embeds, rows):  # one copy to the host for the step's rows
                result.embeddings[out.scheduled[i].seq.seq_id] = row  # [hidden]
        if wants_prompt:
            bs = self.block_size
            spans = [_prompt_span(s) for s in out.scheduled]
            for s, end_row, (first, last), want in zip(out.scheduled, last_row, spans, wants):
                if not want:
                    continue
                row0 = end_row - s.num_new_tokens + 1  # the chunk's first row: position s.start
                seq = s.seq
                if first < last:  # row0 predicts `first`
                    result.prompt_logprobs[seq.seq_id] = (first, score_prompt_rows(
                        self.model.compute_logits, hidden[row0 : row0 + last - first],
                        seq.token_ids[first:last], seq.request.params.prompt_logprobs or 0,
                        self.model.vocab_size,
                    ))  # fmt: skip
                end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens)
                ends = range(s.start + (bs - 1 - s.start % bs), end, bs)  # block-ending positions
                if ends:
                    result.prompt_hidden[seq.seq_id] = {p: hidden[row0 + p - s.start].clone() for p in ends}
        return result

    def _execute_graph(
        self,
        graphs: DecodeGraphs,
        out: SchedulerOutput,
        adapter_slot: dict[str, int] | None,
        patch: InputPatch | None = None,
    ) -> torch.Tensor | None:
        """A pure-decode step through a captured CUDA graph (the eager steps' inputs, rows sorted
        by adapter slot; logits returned in schedule order)."""
        scheduled = out.scheduled
        if graphs.padded_size(len(scheduled)) is None or graphs.disabled:
            return None
        inputs = self.batch.prepare(scheduled, adapter_slot)
        ranges = lora_ranges(inputs.lora_runs) if inputs.lora_runs is not None else None
        fix = None if patch is None else (lambda ids: patch_input_ids(ids, inputs.last_row, patch))
        logits = graphs.run(inputs, ranges, fix)
        if logits is None:
            return None
        order = inputs.order
        if order != list(range(len(order))):  # back to schedule order
            inverse = [0] * len(order)
            for row, i in enumerate(order):
                inverse[i] = row
            logits = logits.index_select(0, to_device(inverse, logits.device, torch.int64))
        if not all(s.samples for s in scheduled):  # a one-token prefill chunk that is not the last
            keep = [i for i, s in enumerate(scheduled) if s.samples]
            logits = logits.index_select(0, to_device(keep, logits.device, torch.int64))
        return logits
