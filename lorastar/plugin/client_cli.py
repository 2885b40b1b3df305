"""``lorastar chat`` and ``lorastar complete``: talk to a running server from a terminal, as vLLM's
``vllm chat`` / ``vllm complete`` do. The model is ``--model-name`` (the base or an adapter; by
default the server's first model), answers stream as they are generated; ``-q/--quick`` sends one
message or prompt and exits, else each line of input is one turn (``chat`` keeps the conversation,
``complete`` completes each line on its own)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:8000/v1"
API_KEY_ENVS = ("LORASTAR_API_KEY", "OPENAI_API_KEY")


class _Client:
    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        base = url.rstrip("/")
        if urlsplit(base).path in ("", "/"):  # http://host:8000: the routes are under /v1
            base += "/v1"
        if api_key and not api_key.isascii():
            raise click.ClickException("the API key has non-ASCII characters")
        self.base, self.timeout = base, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _fail(self, exc: Exception) -> click.ClickException:
        return click.ClickException(f"cannot reach {self.base}: {exc}")

    def first_model(self) -> str:
        try:
            resp = httpx.get(f"{self.base}/models", headers=self.headers, timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._fail(exc) from exc
        _check(resp)
        models = resp.json().get("data") or []
        if not models:
            raise click.ClickException(f"{self.base}/models lists no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any], piece: Any) -> Iterator[str]:
        """The text of each streamed chunk (``piece(choice)`` picks it out of the choice)."""
        try:
            with httpx.stream(
                "POST",
                f"{self.base}{path}",
                json={**body, "stream": True},
                headers=self.headers,
                timeout=self.timeout,
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:  # an error after the stream started
                        raise click.ClickException(str(chunk["error"].get("message", chunk["error"])))
                    for choice in chunk.get("choices", ()):
                        if text := piece(choice):
                            yield text
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._fail(exc) from exc


def _check(resp: httpx.Response) -> None:
    if resp.status_code == 200:
        return
    try:
        body = resp.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
    except (ValueError, AttributeError, KeyError):
        message = " ".join(resp.text.split()) or resp.reason_phrase
    raise click.ClickException(f"{resp.status_code}: {message}")


def _turns(quick: str | None) -> Iterator[str]:
    """The ``--quick`` text alone, else each non-empty input line (a ``> `` prompt on a terminal)."""
    if quick is not None:
        yield quick
        return
    tty = sys.stdin.isatty()
    while True:
        if tty:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _client_options(f: Any) -> Any:
    for option in reversed(
        [
            click.option(
                "--url", default=DEFAULT_URL, show_default=True, help="The server's OpenAI base URL."
            ),
            click.option(
                "--model-name", default=None, help="The base or an adapter (default: the first model)."
            ),
            click.option(
                "--api-key",
                envvar=API_KEY_ENVS,
                default=None,
                help=f"API key (env {' or '.join(API_KEY_ENVS)}).",
            ),
            click.option("-q", "--quick", default=None, metavar="TEXT", help="Send TEXT once and exit."),
            click.option(
                "--max-tokens", default=None, type=click.IntRange(1), help="Most tokens per answer."
            ),
            click.option(
                "--temperature", default=None, type=click.FloatRange(0), help="Sampling temperature."
            ),
            click.option(
                "--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True)
            ),
        ]
    ):
        f = option(f)
    return f


def _sampling(max_tokens: int | None, temperature: float | None) -> dict[str, Any]:
    return {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}


@click.command("chat", help="Chat with a running lorastar (or vLLM) server: vLLM's `vllm chat`.")
@_client_options
@click.option("--system-prompt", default=None, help="A system message first.")
def chat(
    url: str,
    model_name: str | None,
    api_key: str | None,
    quick: str | None,
    max_tokens: int | None,
    temperature: float | None,
    timeout: float,
    system_prompt: str | None,
) -> None:
    client = _Client(url, api_key, timeout)
    model = model_name or client.first_model()
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for text in _turns(quick):
        messages.append({"role": "user", "content": text})
        answer: list[str] = []
        body = {"model": model, "messages": messages, **_sampling(max_tokens, temperature)}
        for piece in client.stream(
            "/chat/completions", body, lambda c: (c.get("delta") or {}).get("content")
        ):
            answer.append(piece)
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": "".join(answer)})


@click.command("complete", help="Complete prompts on a running lorastar (or vLLM) server: `vllm complete`.")
@_client_options
def complete(
    url: str,
    model_name: str | None,
    api_key: str | None,
    quick: str | None,
    max_tokens: int | None,
    temperature: float | None,
    timeout: float,
) -> None:
    client = _Client(url, api_key, timeout)
    model = model_name or client.first_model()
    for text in _turns(quick):
        body = {"model": model, "prompt": text, **_sampling(max_tokens, temperature)}
        for piece in client.stream("/completions", body, lambda c: c.get("text")):
            click.echo(piece, nl=False)
        click.echo()
