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

from lorastar.plugin.tls_client import TLS_FIELDS, ssl_verify, tls_hint, tls_options

DEFAULT_URL = "http://127.0.0.1:8000/v1"
API_KEY_ENVS = ("LORASTAR_API_KEY", "OPENAI_API_KEY")


class _Client:
    def __init__(self, url: str, api_key: str | None, timeout: float, **tls: Any) -> None:
        base = url.rstrip("/")
        if urlsplit(base).path in ("", "/"):  # http://host:8000: the routes are under /v1
            base += "/v1"
        if api_key and not api_key.isascii():
            raise click.ClickException("the API key has non-ASCII characters")
        self.base, self.timeout = base, timeout
        self.verify, self.client_cert = ssl_verify(**tls), tls.get("client_cert")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _fail(self, exc: Exception) -> click.ClickException:
        return click.ClickException(
            f"cannot reach {self.base}: {exc}{tls_hint(exc, self.base, self.client_cert)}"
        )

    def first_model(self) -> str:
        try:
            resp = httpx.get(
                f"{self.base}/models", headers=self.headers, timeout=self.timeout, verify=self.verify
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._fail(exc) from exc
        _check(resp)
        try:
            return str(resp.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError) as exc:  # not JSON (a login page), no models
            raise click.ClickException(f"{self.base}/models lists no model: {_short(resp.text)}") from exc

    def stream(self, path: str, body: dict[str, Any], piece: Any) -> Iterator[Any]:
        """What ``piece(choice)`` picks out of each streamed chunk's choices (falsy: nothing)."""
        try:
            with httpx.stream(
                "POST",
                f"{self.base}{path}",
                json={**body, "stream": True},
                headers=self.headers,
                timeout=self.timeout,
                verify=self.verify,
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].removeprefix(" ")  # the space is optional (SSE)
                    if data == "[DONE]":
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        raise click.ClickException(f"not an OpenAI stream: {_short(data)}")
                    if (err := chunk.get("error")) is not None:  # an error after the stream started
                        raise click.ClickException(
                            str(err.get("message", err) if isinstance(err, dict) else err)
                        )
                    for choice in chunk.get("choices", ()):
                        if text := piece(choice):
                            yield text
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._fail(exc) from exc


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:200] + "..."


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
        yield _utf8(quick)
        return
    if sys.stdin is None:  # no stdin at all (a service): nothing to read
        return
    tty = sys.stdin.isatty()
    while True:
        if tty:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield _utf8(line.rstrip("\n"))


def _utf8(text: str) -> str:
    """Bytes that were not UTF-8 (Python keeps them as surrogate escapes, which JSON cannot carry)
    as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


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
    return tls_options()(f)


def _chat_piece(choice: dict[str, Any]) -> tuple[str, bool] | None:
    """A chat chunk's text and whether it is the answer; a reasoning model's thinking
    (``reasoning_content``, newer vLLM's ``reasoning``) is shown too, as it streams."""
    delta = choice.get("delta") or {}
    if text := delta.get("content"):
        return text, True
    if text := delta.get("reasoning_content") or delta.get("reasoning"):
        return text, False
    return None


def _session(opts: dict[str, Any]) -> tuple[_Client, dict[str, Any], Iterator[str]]:
    """The client, each request's fields (model, --max-tokens, --temperature) and the turns."""
    client = _Client(opts["url"], opts["api_key"], opts["timeout"], **{k: opts[k] for k in TLS_FIELDS})
    fields = {"model": opts["model_name"] or client.first_model()}
    fields.update({k: opts[k] for k in ("max_tokens", "temperature") if opts[k] is not None})
    return client, fields, _turns(opts["quick"])


@click.command("chat", help="Chat with a running lorastar (or vLLM) server: vLLM's `vllm chat`.")
@_client_options
@click.option("--system-prompt", default=None, help="A system message first.")
def chat(system_prompt: str | None, **opts: Any) -> None:
    client, fields, turns = _session(opts)
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for text in turns:
        messages.append({"role": "user", "content": text})
        answer: list[str] = []
        for piece, is_answer in client.stream(
            "/chat/completions", {**fields, "messages": messages}, _chat_piece
        ):
            if is_answer:
                answer.append(piece)  # the conversation keeps the answer, not the thinking
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": "".join(answer)})


@click.command("complete", help="Complete prompts on a running lorastar (or vLLM) server: `vllm complete`.")
@_client_options
def complete(**opts: Any) -> None:
    client, fields, turns = _session(opts)
    for text in turns:
        for piece in client.stream("/completions", {**fields, "prompt": text}, lambda c: c.get("text")):
            click.echo(piece, nl=False)
        click.echo()
