"""TLS for the terminal clients (``lorastar lora``, ``lorastar chat``, ``lorastar complete``).

``lorastar serve --ssl-keyfile/--ssl-certfile`` serves HTTPS, and ``--ssl-cert-reqs 2`` with
``--ssl-ca-certs`` asks every client for a certificate. These options let the clients reach such a
server: ``--ca-certs`` (the certificates to trust, e.g. the server's self-signed one; without it the
system's and ``SSL_CERT_FILE``'s), ``--insecure`` (no verification of the server, curl's ``-k``), and
``--client-cert``/``--client-key`` (the certificate to present). Plain ``http://`` URLs ignore them.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import click
import httpx

F = TypeVar("F", bound=Callable[..., Any])

CA_CERTS_ENV = "LORASTAR_CA_CERTS"
CLIENT_CERT_ENV = "LORASTAR_CLIENT_CERT"
CLIENT_KEY_ENV = "LORASTAR_CLIENT_KEY"
TLS_FIELDS = ("ca_certs", "insecure", "client_cert", "client_key")


def tls_options(env: bool = True) -> Callable[[F], F]:
    """``--ca-certs/--insecure/--client-cert/--client-key``; each is ``None`` when not given (so a
    command's own value can override its group's). ``env``: read the files' environment variables."""
    file = click.Path(exists=True, dir_okay=False)

    def deco(f: F) -> F:
        f = click.option(
            "--client-key",
            type=file,
            envvar=CLIENT_KEY_ENV if env else None,
            default=None,
            help=f"The private key of --client-cert, when that file lacks it (env {CLIENT_KEY_ENV}).",
        )(f)
        f = click.option(
            "--client-cert",
            type=file,
            envvar=CLIENT_CERT_ENV if env else None,
            default=None,
            help="A certificate (PEM) to present, for a server started with --ssl-cert-reqs 2 "
            f"(env {CLIENT_CERT_ENV}).",
        )(f)
        f = click.option(
            "--insecure",
            "-k",
            is_flag=True,
            default=None,
            help="Do not verify the server's certificate (as curl's -k).",
        )(f)
        return click.option(
            "--ca-certs",
            type=file,
            envvar=CA_CERTS_ENV if env else None,
            default=None,
            help="Trust the certificates in this PEM file (e.g. the server's self-signed --ssl-certfile) "
            f"instead of the system's (env {CA_CERTS_ENV}; SSL_CERT_FILE also works).",
        )(f)

    return deco


def ssl_verify(
    ca_certs: str | None = None,
    insecure: bool | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> ssl.SSLContext | bool:
    """httpx's ``verify``: ``True`` (its defaults) when no option is given, else a context built
    from them. A file that is not what it should be is a ``click.UsageError`` naming the option."""
    if client_key and not client_cert:
        raise click.UsageError("--client-key needs --client-cert")
    if not (ca_certs or insecure or client_cert):
        return True
    if insecure and ca_certs:
        raise click.UsageError("--insecure and --ca-certs contradict each other: give one")
    try:
        ctx = httpx.create_ssl_context() if not ca_certs else ssl.create_default_context(cafile=ca_certs)
    except (ssl.SSLError, ValueError) as exc:
        raise click.UsageError(f"--ca-certs {ca_certs!r} holds no PEM certificate: {exc}") from None
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if client_cert:
        try:
            ctx.load_cert_chain(client_cert, client_key)
        except (ssl.SSLError, ValueError) as exc:
            what = f"--client-cert {client_cert!r}" + (
                f" / --client-key {client_key!r}" if client_key else ""
            )
            raise click.UsageError(
                f"cannot use {what} as a client certificate (a PEM certificate and its private key, "
                f"in one file or with --client-key): {exc}"
            ) from None
    return ctx


def tls_hint(exc: BaseException, url: str, client_cert: str | None) -> str:
    """What to do about a failure to reach ``url``, appended to its message ("" when no TLS hint fits).
    A server that asks for client certificates closes a TLS 1.3 connection without one, or with one it
    does not trust, after the handshake: the client sees only a disconnection."""
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return " (to trust a self-signed server: --ca-certs its-cert.pem, or --insecure)"
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return " (https:// to a server that speaks plain HTTP? try http://)"
    if url.startswith("https://") and (
        "CERTIFICATE_REQUIRED" in text or "UNKNOWN_CA" in text or "disconnected" in text
    ):
        if client_cert:
            return " (does the server trust this --client-cert?)"
        return " (if the server asks for a client certificate: --client-cert, --client-key)"
    return ""
