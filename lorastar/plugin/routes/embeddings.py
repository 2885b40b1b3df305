"""``/embeddings`` (OpenAI's, as vLLM serves decoder embedding models such as Qwen3-Embedding):
each input's last token's final hidden state, L2-normalized, from the base model or an adapter."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from litestar import Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from lorastar.engine.outputs import normalized
from lorastar.engine.sampling import embedding_params
from lorastar.plugin.errors import APIError, error_responses
from lorastar.plugin.request_id import request_ids
from lorastar.plugin.routes.common import (
    OK_DOC,
    check_batch_size,
    collect,
    in_thread,
    make_usage,
    parse_prompts,
    tokenize,
    truncate_prompt,
    vocab_size,
)
from lorastar.plugin.schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from lorastar.plugin.service import LoraStarService, merge_streams, run_until_disconnect


def encode(values: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: the float32 values, little-endian, base64 (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def build_embeddings_handler(service: LoraStarService, guards: list[Any]) -> Any:
    @post(
        "/embeddings",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="OpenAI embeddings",
        responses={
            200: ResponseSpec(EmbeddingResponse, description=OK_DOC),
            **error_responses(400, *((401,) if guards else ()), 404, 413, 503),
        },
    )
    async def create_embedding(data: EmbeddingRequest, request: Request[Any, Any, Any]) -> Response[Any]:
        engine = await service.ready()
        adapter = await service.resolve_adapter(data.model, data.adapter_id)
        inputs = parse_prompts(data.input, vocab_size(engine.tokenizer), "input")
        check_batch_size(len(inputs), engine.max_waiting, "input", "inputs")  # a request each
        max_model_len = int(engine.max_model_len)
        token_ids = [
            p if isinstance(p, list) else await in_thread(tokenize, engine, p, data.add_special_tokens)
            for p in inputs
        ]
        token_ids = [truncate_prompt(ids, data.truncate_prompt_tokens, max_model_len) for ids in token_ids]
        for ids in token_ids:
            if not ids:
                raise APIError("input must not be empty.", param="input")
            if len(ids) >= max_model_len:
                raise APIError(
                    f"This model's maximum context length is {max_model_len} tokens. However, your "
                    f"request has {len(ids)} input tokens. Please reduce the length of the input "
                    "(or set truncate_prompt_tokens).",
                    param="input",
                )
        params = embedding_params()
        request_id, engine_id = request_ids("embd", request, data.request_id)
        streams = [
            service.generate(ids, params, adapter, f"{engine_id}-{i}", data.priority)
            for i, ids in enumerate(token_ids)
        ]
        finals = await run_until_disconnect(collect(merge_streams(streams), data.model), request.receive)
        norm = data.normalize is not False
        items = []
        for i in range(len(token_ids)):
            vector = finals[i].embedding
            if vector is None:  # the engine ended the request without one (an abort)
                raise APIError(
                    "the embedding request was aborted.", HTTP_503_SERVICE_UNAVAILABLE, param="input"
                )
            if data.dimensions is not None:
                if data.dimensions > len(vector):
                    raise APIError(
                        f"dimensions must be at most this model's {len(vector)}, got {data.dimensions}.",
                        param="dimensions",
                    )
                vector = vector[: data.dimensions]
            items.append(
                EmbeddingData(i, encode(normalized(vector) if norm else vector, data.encoding_format))
            )
        prompt_tokens = sum(len(ids) for ids in token_ids)
        cached = sum(int(finals[i].num_cached_tokens or 0) for i in range(len(token_ids)))
        return Response(
            EmbeddingResponse(
                id=request_id,
                created=int(time.time()),
                model=data.model or service.served_model_name,
                data=items,
                usage=make_usage(prompt_tokens, 0, cached),
            ),
            status_code=HTTP_200_OK,
        )

    return create_embedding
