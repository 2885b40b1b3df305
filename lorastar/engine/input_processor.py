"""Prompt checks and tokenization: what a frontend does before a request reaches the engine core.

``LLMEngine`` uses one for its own ``add_request``; a frontend talking to a core in another process
(engine/core_client.py) builds its own from the same tokenizer folder, so a prompt is tokenized once,
in the frontend, and the core only checks the ids it receives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lorastar.engine.chat_content import content_format, template_content, texts_of
from lorastar.errors import InvalidParamError, LimitExceededError


def load_tokenizer(folder: Path, chat_template: str | None = None) -> Any:
    """The folder's transformers tokenizer (no network), with ``chat_template`` replacing its own."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:  # transformers' messages name neither the folder nor the setting
        raise ValueError(f"tokenizer: cannot load a tokenizer from {str(folder)!r}: {e}") from e
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


class TokenizerLoader:
    """``load_tokenizer(folder, chat_template)`` once, on the first ``get()``; thread-safe.

    An engine core in a process of its own tokenizes no prompt (its frontend sends ids): it needs
    the tokenizer only for ``bad_words`` and ``guided_choice`` texts (and, at start, KV-scale
    calibration or an EOS id that no ``generation_config.json`` names). Importing transformers and
    loading the tokenizer took 5.6 of the core's 6.9 s start (SmolLM2 on this 2-core CPU, cProfile),
    so that core starts without it and loads it in the background (``load_in_background``)."""

    def __init__(self, folder: Path, chat_template: str | None = None) -> None:
        self.folder = folder
        self.chat_template = chat_template
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def get(self) -> Any:
        tok = self._tokenizer
        if tok is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.folder, self.chat_template)
                tok = self._tokenizer
        return tok

    def load_in_background(self) -> threading.Thread:
        """Start loading on a daemon thread (a failure is logged; the next ``get()`` tries again)."""

        def run() -> None:
            try:
                self.get()
            except Exception:  # noqa: BLE001 - get() raises it again where it is needed
                logging.getLogger("lorastar").exception("lorastar: loading the tokenizer failed")

        t = threading.Thread(target=run, name="lorastar-tokenizer-load", daemon=True)
        t.start()
        return t


def resolve_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer itself, loaded first where ``tokenizer`` is a ``TokenizerLoader``."""
    return tokenizer.get() if isinstance(tokenizer, TokenizerLoader) else tokenizer


def _template_parameters(tokenizer: Any) -> set[str]:
    """The named parameters of ``tokenizer.apply_chat_template`` (its ``**kwargs`` excluded), and the
    names the rendering itself passes (transformers' ``render_jinja_template``: ``conversations``,
    then ``messages`` into the template)."""
    import inspect

    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} | {
        "conversations",
        "messages",
    }


class InputProcessor:
    """Validates and tokenizes prompts for one model. Stateless apart from its limits; thread-safe
    as far as the tokenizer is (transformers' fast tokenizers are). ``tokenizer``: the tokenizer, or
    a ``TokenizerLoader`` (loaded when text first needs it: checking token ids does not)."""

    def __init__(
        self, tokenizer: Any, *, model_name: str, max_model_len: int, max_prompt_bytes: int, vocab_size: int
    ) -> None:
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_prompt_bytes
        self.vocab_size = vocab_size

    @property
    def tokenizer(self) -> Any:
        return resolve_tokenizer(self._tokenizer)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self.check_prompt_size(prompt)
        return self._ids(prompt, add_special_tokens, "prompt")

    def _ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except TypeError:  # the tokenizer's "TextEncodeInput must be Union[...]": say why, naming param
            _check_unicode(text, param)
            raise

    def check_prompt_size(self, text: str | Sequence[str], param: str = "prompt") -> None:
        """Refuse text over ``max_prompt_bytes`` before any tokenizing (a 9 MB prompt would hold
        a tokenizer thread for seconds only to be refused for its length)."""
        texts = [text] if isinstance(text, str) else text
        limit = self.max_prompt_bytes
        size = 0
        for t in texts:
            if len(t) > limit:  # characters <= bytes: no need to encode a huge string
                size = len(t)
                break
            size += len(t.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise LimitExceededError(
                param, f"{param} is over {limit} bytes (max_prompt_bytes); shorten the input."
            )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The messages rendered by the model's chat template, then tokenized; ``add_special_tokens``
        (vLLM's field, off by default: templates write their own BOS) adds what the tokenizer adds to
        any text, such as a BOS. ``continue_final_message`` (vLLM's, exclusive with
        ``add_generation_prompt``) leaves the last message open for the model to continue (an
        assistant prefill); ``chat_template_kwargs`` are extra template variables (Qwen3's
        ``enable_thinking``), never one of ``apply_chat_template``'s own parameters; ``tools``: the
        OpenAI function definitions, which the template renders into the prompt (its ``tools``);
        ``documents``: vLLM's RAG documents (``{"title", "text"}``), the template's ``documents``."""
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidParamError("messages", "messages must be a list of {'role', 'content'} objects")
        if not messages:
            raise InvalidParamError("messages", "messages must not be empty")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise InvalidParamError("tools", "tools must be a list of objects")
        if documents is not None and (
            not isinstance(documents, list) or not all(isinstance(d, Mapping) for d in documents)
        ):
            raise InvalidParamError("documents", "documents must be a list of objects")
        if continue_final_message and add_generation_prompt:
            raise InvalidParamError(
                "continue_final_message",
                "Cannot set both continue_final_message and add_generation_prompt to true.",
            )
        extra = self._template_kwargs(chat_template_kwargs)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidParamError("messages", f"model {self.model_name!r} has no chat template")
        texts = [t for m in messages for t in texts_of(m.get("content"))]
        texts += [v for d in documents or [] for v in d.values() if isinstance(v, str)]  # in the prompt too
        self.check_prompt_size(texts, "messages")
        try:  # the template the tokenizer will pick (a named "tool_use" one when tools are given)
            fmt = content_format(self.tokenizer.get_chat_template(None, tools))
        except Exception:  # noqa: BLE001 - no usable template: rendering says why
            fmt = "string"
        messages = [
            {**m, "content": template_content(m["content"], fmt, i)} if "content" in m else dict(m)
            for i, m in enumerate(messages)
        ]  # (no content at all: the template says what it lacks)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=[dict(t) for t in tools] if tools else None,
                documents=[dict(d) for d in documents] if documents else None, **extra,
            )  # fmt: skip
        except Exception as exc:  # jinja's UndefinedError / TemplateError: what the messages lack
            raise InvalidParamError(
                "messages", f"messages could not be rendered by the chat template: {exc}"
            ) from exc
        return self._ids(text, add_special_tokens, "messages")

    def _template_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs`` checked: string keys, none of them a parameter of the tokenizer's
        ``apply_chat_template`` (``tokenize``, ``chat_template``, ``tools``...: a client may set template
        variables, not how the template is chosen or its output returned)."""
        if not kwargs:
            return {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise InvalidParamError("chat_template_kwargs", "chat_template_kwargs must be an object")
        reserved = sorted(set(kwargs) & _template_parameters(self.tokenizer))
        if reserved:
            raise InvalidParamError(
                "chat_template_kwargs",
                f"chat_template_kwargs may not set {', '.join(reserved)}: they are not template variables.",
            )
        return dict(kwargs)

    def validate_prompt(self, prompt: str | list[int] | Mapping[str, Any]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt given as text, ids, or vLLM's ``{"prompt": text}``
        (TextPrompt) / ``{"prompt_token_ids": ids}`` (TokensPrompt); ``InvalidParamError`` naming
        ``prompt`` when it is empty, malformed, outside the vocabulary or too long."""
        if isinstance(prompt, Mapping):
            prompt = prompt_of_dict(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParamError("prompt", "prompt must not be empty")
            text, ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidParamError("prompt", "prompt must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidParamError("prompt", "prompt_token_ids must be a list of integers")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidParamError(
                    "prompt",
                    f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                )
            text, ids = None, list(prompt)
        else:
            raise InvalidParamError(
                "prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidParamError("prompt", "prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise InvalidParamError(
                "prompt",
                f"prompt is {len(ids)} tokens, over the limit: max_model_len is {self.max_model_len} "
                "(prompt + at least one generated token)",
            )
        return text, ids


def _check_unicode(text: str, param: str) -> None:
    """Refuse text holding a lone surrogate (Python's API lets one in, e.g. from a file read with
    ``errors="surrogateescape"``; JSON bodies cannot), which the tokenizer refuses with a
    ``TypeError`` naming no field. Called once tokenizing failed: no second pass over every prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParamError(
            param, f"{param} is not valid Unicode: it holds a lone surrogate ({exc.object[exc.start]!r})."
        ) from None


def prompt_of_dict(prompt: Mapping[str, Any]) -> str | list[int]:
    """The text or token ids of vLLM's TextPrompt / TokensPrompt dict (token ids win where both are
    given, as in vLLM); a key lorastar does not take (``multi_modal_data``...) is refused, naming it."""
    if extra := sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids")):
        raise InvalidParamError(
            "prompt",
            f"prompt dict key {extra[0]!r} is not supported: give 'prompt' (text) or 'prompt_token_ids'",
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise InvalidParamError("prompt", "prompt_token_ids must be a list of integers")
        return ids  # type: ignore[no-any-return]
    if "prompt" in prompt:
        if not isinstance(text := prompt["prompt"], str):
            raise InvalidParamError("prompt", f"prompt must be a string, got {type(text).__name__}")
        return text
    raise InvalidParamError("prompt", "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


class PromptInputs:
    """``tokenize``, ``check_prompt_size`` and ``apply_chat_template`` for a class that holds an
    ``InputProcessor`` as ``inputs``: the engine, the in-process client (its engine's) and the
    core-process client (its own), one definition for the three. Blocking: the HTTP layer calls
    them from a worker thread."""

    inputs: InputProcessor

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt`` as ``generate`` would see them (special tokens added unless
        ``add_special_tokens`` is off); text over ``max_prompt_bytes`` is refused before tokenizing."""
        return self.inputs.tokenize(prompt, add_special_tokens)

    def check_prompt_size(self, text: str | Sequence[str], param: str = "prompt") -> None:
        self.inputs.check_prompt_size(text, param)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.inputs.apply_chat_template(
            messages, add_generation_prompt, add_special_tokens,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
            tools=tools, documents=documents,
        )  # fmt: skip
