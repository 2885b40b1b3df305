"""The ``lora`` click group: ``list|load NAME PATH|unload NAME`` against a running server over HTTP.

Kept apart from ``cli.py`` (which builds apps) so that ``plugin.py`` can add the group to the
``litestar`` CLI without an import cycle. ``--url`` is the server's base URL; the plugin's path
(``/v1`` or wherever it is mounted) is found by probing, so ``http://host:8000`` and
``http://host:8000/v1`` both work. An ``https://`` server with a self-signed certificate or one
that asks for client certificates takes ``--ca-certs``/``--insecure``/``--client-cert`` (``tls_client``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import httpx

from lorastar.plugin.config import ADMIN_TOKEN_ENV
from lorastar.plugin.tls_client import TLS_FIELDS, ssl_verify, tls_hint, tls_options

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "LORASTAR_URL"
API_KEY_ENV = "LORASTAR_API_KEY"
_META_KEY = "lorastar.lora"

F = TypeVar("F", bound=Callable[..., Any])


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return " ".join(resp.text.split()) or resp.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)


def _api_bases(url: str, plugin_path: str) -> list[str]:
    """Candidate bases of the OpenAI routes under the server URL ``url``, most likely first."""
    url = url.rstrip("/")
    path = "/" + plugin_path.strip("/") if plugin_path.strip("/") else ""
    if path and url.endswith(path):
        return [url]
    return [url + path, url] if path else [url]


class _Client:
    def __init__(
        self,
        url: str,
        plugin_path: str,
        token: str | None,
        api_key: str | None,
        timeout: float,
        **tls: Any,
    ):
        self.url, self.plugin_path, self.timeout = url, plugin_path, timeout
        self.token, self.api_key = token, api_key or token
        self.verify, self.client_cert = ssl_verify(**tls), tls.get("client_cert")
        self._base: str | None = None

    def _send(self, method: str, url: str, token: str | None, json: Any = None) -> httpx.Response:
        if token and not token.isascii():  # httpx sends headers as ASCII
            raise click.ClickException("the token / API key has non-ASCII characters")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            return httpx.request(
                method, url, json=json, headers=headers, timeout=self.timeout, verify=self.verify
            )
        except httpx.InvalidURL as exc:  # not an httpx.HTTPError: e.g. a typo in the port
            raise click.ClickException(f"invalid --url {self.url!r}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise click.ClickException(
                f"cannot reach {url}: {exc or type(exc).__name__}{tls_hint(exc, url, self.client_cert)}"
            ) from exc

    def base(self) -> str:
        """The OpenAI base: the first candidate whose ``/models`` route exists (404 means: not here)."""
        if self._base is None:
            candidates = _api_bases(self.url, self.plugin_path)
            for cand in candidates:
                if self._send("GET", cand + "/models", self.api_key).status_code != 404:
                    self._base = cand
                    break
            else:
                raise click.ClickException(
                    f"no lorastar server at {self.url} (tried {', '.join(c + '/models' for c in candidates)})"
                )
        return self._base

    def _missing(self, route: str) -> bool:
        """Whether the server has no such route: a mounted POST route answers GET with 405, an
        adapter that is not there is a 404 of the mounted route."""
        return self._send("GET", self.base() + route, self.token).status_code == 404

    def request(self, method: str, route: str, *, admin: bool, json: Any = None) -> httpx.Response:
        resp = self._send(method, self.base() + route, self.token if admin else self.api_key, json)
        if resp.status_code == 404 and admin and self._missing(route):
            raise click.ClickException(
                f"runtime adapter loading is off on the server at {self.url} (started with "
                "--no-runtime-loading, or allow_runtime_adapter_loading=False in its app): its "
                "adapters are the ones it started with (HTTP 404)"
            )
        if resp.status_code >= 400:
            raise click.ClickException(f"{_error_message(resp)} (HTTP {resp.status_code})")
        return resp


def _positive_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    # A socket timeout must be finite and positive (else a ValueError/OverflowError traceback).
    if value is not None and not 0 < value < 1e9:
        raise click.BadParameter("give a positive number of seconds", ctx, param)
    return value


def _first_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # `serve` takes a variable holding several keys ("k1 k2") as several keys: send the first
    return value.split()[0] if value and value.split() else value


def _connection_options(group: bool, default_url: str) -> Callable[[F], F]:
    """``--url/--token/--api-key/--timeout`` and the TLS options: on the group (with env and
    defaults) and on each command."""

    def deco(f: F) -> F:
        env = (lambda name: name) if group else (lambda name: None)
        f = tls_options(env=group)(f)
        f = click.option(
            "--timeout",
            type=float,
            callback=_positive_seconds,
            default=120.0 if group else None,
            help="Seconds to wait for the server." + (" [default: 120]" if group else ""),
        )(f)
        f = click.option(
            "--api-key",
            envvar=[API_KEY_ENV, "VLLM_API_KEY"] if group else None,  # the variables `serve` reads
            callback=_first_key,
            default=None,
            help=f"API key for listing when the server has api_keys (env {API_KEY_ENV} or VLLM_API_KEY; "
            "default: --token).",
        )(f)
        f = click.option(
            "--token",
            envvar=env(ADMIN_TOKEN_ENV),
            default=None,
            help=f"Admin bearer token (env {ADMIN_TOKEN_ENV}).",
        )(f)
        return click.option(
            "--url",
            envvar=env(URL_ENV),
            default=default_url if group else None,
            help=f"Server base URL, e.g. {DEFAULT_URL} (env {URL_ENV}; default {default_url}).",
        )(f)

    return deco


def _client(**overrides: Any) -> _Client:
    # ctx.meta, not ctx.obj: under the litestar CLI ctx.obj is Litestar's own LitestarEnv.
    settings = dict(click.get_current_context().meta[_META_KEY])
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return _Client(**settings)


def local_adapter_path(path: str) -> str:
    """A relative path that exists here is sent absolute (the server resolves relative paths under its
    adapter root, and refuses absolute ones outside it); anything else is sent as written."""
    p = Path(path).expanduser()
    if not p.is_absolute() and p.is_dir():
        return str(p.resolve())
    return path


def make_lora_group(default_url: str = DEFAULT_URL, plugin_path: str = "/v1") -> click.Group:
    """A fresh ``lora`` group (a new object per call: the litestar CLI and ours each get their own)."""

    @click.group("lora", help="Manage the LoRA adapters of a running lorastar server.")
    @_connection_options(True, default_url)
    def lora(url: str, token: str | None, api_key: str | None, timeout: float, **tls: Any) -> None:
        # No click.pass_context / `ctx` parameters: the litestar CLI wraps callbacks and injects `ctx` itself.
        click.get_current_context().meta[_META_KEY] = dict(
            url=url, plugin_path=plugin_path, token=token, api_key=api_key, timeout=timeout,
            **{k: tls[k] for k in TLS_FIELDS},
        )  # fmt: skip

    @lora.command("list", help="List the base model and the loaded adapters.")
    @_connection_options(False, default_url)
    def list_cmd(**conn: Any) -> None:
        client = _client(**conn)
        resp = client.request("GET", "/models", admin=False)
        try:
            data = resp.json()["data"]
            ok = isinstance(data, list) and all(
                isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
            )
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:  # e.g. another web server on that port answering HTML
            raise click.ClickException(
                f"{client.base()}/models did not answer an OpenAI model list; is --url a lorastar server?"
            )
        base = [m for m in data if not m.get("parent")]
        adapters = [m for m in data if m.get("parent")]
        for m in base:
            click.echo(f"base model: {m['id']} (max_model_len {m.get('max_model_len')})")
        if not adapters:
            click.echo("no adapters loaded")
            return
        width = max(len("NAME"), *(len(m["id"]) for m in adapters))
        click.echo(f"{'NAME'.ljust(width)}  PATH")
        for m in adapters:
            click.echo(f"{m['id'].ljust(width)}  {m.get('root') or ''}")

    @lora.command("load", help="Load the PEFT adapter folder PATH (under the server's adapter root) as NAME.")
    @click.argument("name")
    @click.argument("path")
    @click.option("--replace", is_flag=True, help="Replace an adapter already loaded under NAME.")
    @_connection_options(False, default_url)
    def load_cmd(name: str, path: str, replace: bool, **conn: Any) -> None:
        client = _client(**conn)
        sent = local_adapter_path(path)
        body = {"lora_name": name, "lora_path": sent, "load_inplace": replace}
        try:
            resp = client.request("POST", "/load_lora_adapter", admin=True, json=body)
        except click.ClickException as exc:
            # The local folder lies outside the server's root: try the path as written (under the root).
            if sent == path or "(HTTP 403)" not in exc.message:
                raise
            resp = client.request("POST", "/load_lora_adapter", admin=True, json={**body, "lora_path": path})
        click.echo(resp.text.strip())

    @lora.command("unload", help="Unload the adapter NAME.")
    @click.argument("name")
    @_connection_options(False, default_url)
    def unload_cmd(name: str, **conn: Any) -> None:
        resp = _client(**conn).request("POST", "/unload_lora_adapter", admin=True, json={"lora_name": name})
        click.echo(resp.text.strip())

    return lora
