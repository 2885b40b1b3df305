"""vLLM's OpenAI routes under the plugin's path: models, completions, chat completions, embeddings,
responses, and Anthropic's messages."""

from __future__ import annotations

from typing import Any

from lorastar.plugin.routes.chat import build_chat_handler
from lorastar.plugin.routes.completions import build_completion_handler
from lorastar.plugin.routes.embeddings import build_embeddings_handler
from lorastar.plugin.routes.messages import build_messages_handlers
from lorastar.plugin.routes.models import build_model_handlers
from lorastar.plugin.routes.responses import build_responses_handlers
from lorastar.plugin.service import LoraStarService


def build_openai_handlers(service: LoraStarService, guards: list[Any] | None = None) -> list[Any]:
    """Route handlers bound to ``service`` (closures: one set per plugin instance)."""
    guards = guards or []
    return [
        *build_model_handlers(service, guards),
        build_completion_handler(service, guards),
        build_chat_handler(service, guards),
        build_embeddings_handler(service, guards),
        *build_responses_handlers(service, guards),
        *build_messages_handlers(service, guards),
    ]
