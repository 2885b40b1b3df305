"""The terminal clients (``lorastar lora``, ``chat``, ``complete``) against ``lorastar serve`` over
HTTPS with client certificates required (``--ssl-cert-reqs 2``): ``--ca-certs`` trusts a self-signed
server, ``--insecure`` skips the check, ``--client-cert``/``--client-key`` present a certificate; each
failure is one line that says which option is missing."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from plugin_support import free_port
from test_serve_tls_access_log import self_signed

from lorastar.plugin.cli import main


class Served:
    url: str
    key: Path
    cert: Path
    other_key: Path
    other_cert: Path
    adapter: Path


@pytest.fixture(scope="module")
def mtls_server(
    tiny_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("tls")
    (folder / "other").mkdir()
    s = Served()
    s.key, s.cert = self_signed(folder)  # the server's certificate, and the one clients present
    s.other_key, s.other_cert = self_signed(folder / "other")  # a certificate the server does not trust
    s.adapter = adapter_root / "gamma"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", str(tiny_model_dir), "--served-model-name", "tiny",
         "--port", str(port), "--device", "cpu", "--no-engine-process", "--disable-log-stats",
         "--adapter-root", str(adapter_root), "--admin-token", "adm",
         "--ssl-keyfile", str(s.key), "--ssl-certfile", str(s.cert), "--ssl-ca-certs", str(s.cert),
         "--ssl-cert-reqs", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    s.url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            try:
                r = httpx.get(s.url + "/health", verify=client_context(s))
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield s
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def client_context(s: Served) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(s.cert))
    ctx.load_cert_chain(str(s.cert), str(s.key))
    return ctx


def run(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env, input=input)


def test_lora_commands_with_a_client_certificate(mtls_server: Any) -> None:
    s = mtls_server
    tls = ["--ca-certs", str(s.cert), "--client-cert", str(s.cert), "--client-key", str(s.key)]
    r = run("lora", "--url", s.url, "--token", "adm", *tls, "load", "g", str(s.adapter))
    assert r.exit_code == 0, r.output
    # the files from the environment, on the group; --insecure on the command
    env = {"LORASTAR_CLIENT_CERT": str(s.cert), "LORASTAR_CLIENT_KEY": str(s.key)}
    r = run("lora", "--url", s.url, "list", "--insecure", env=env)
    assert r.exit_code == 0, r.output
    assert ["g", "gamma"] in [line.split() for line in r.output.splitlines()], r.output
    r = run("lora", "--url", s.url, "--token", "adm", "unload", "g", *tls)
    assert r.exit_code == 0, r.output
    assert "no adapters loaded" in run("lora", "--url", s.url, "list", "-k", env=env).output


def test_chat_and_complete_with_a_client_certificate(mtls_server: Any) -> None:
    s = mtls_server
    tls = ["--ca-certs", str(s.cert), "--client-cert", str(s.cert), "--client-key", str(s.key)]
    direct = httpx.post(
        s.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        verify=client_context(s),
    ).json()["choices"][0]["text"]
    r = run("complete", "--url", s.url, *tls, "-q", "Hello", "--max-tokens", "4", "--temperature", "0")
    assert r.exit_code == 0, r.output
    assert r.output == direct + "\n"
    r = run("chat", "--url", s.url, "-k", "--client-cert", str(s.cert), "--client-key", str(s.key),
            "-q", "Hi", "--max-tokens", "3")  # fmt: skip
    assert r.exit_code == 0 and r.output.strip(), r.output


@pytest.mark.parametrize("command", [["lora", "list"], ["complete", "-q", "Hi"]])
def test_each_missing_piece_is_named(mtls_server: Any, command: list[str]) -> None:
    s = mtls_server
    cert = ["--client-cert", str(s.cert), "--client-key", str(s.key)]
    # the server's certificate is self-signed: not trusted by default
    r = run(command[0], "--url", s.url, *command[1:], *cert)
    assert r.exit_code == 1 and "CERTIFICATE_VERIFY_FAILED" in r.output, r.output
    assert "--ca-certs" in r.output and "--insecure" in r.output
    # trusted, but no client certificate: the server refuses the connection
    r = run(command[0], "--url", s.url, *command[1:], "--ca-certs", str(s.cert))
    assert r.exit_code == 1 and "--client-cert" in r.output, r.output
    # a certificate the server does not trust
    r = run(command[0], "--url", s.url, *command[1:], "-k", "--client-cert", str(s.other_cert),
            "--client-key", str(s.other_key))  # fmt: skip
    assert r.exit_code == 1 and "does the server trust this --client-cert?" in r.output, r.output
    assert "Traceback" not in r.output


def test_https_to_a_plain_http_server_says_so(real_server: Any) -> None:
    url = real_server.url.replace("http://", "https://")
    for command in (["lora", "--url", url, "list"], ["complete", "--url", url, "-q", "Hi"]):
        r = run(*command)
        assert r.exit_code == 1 and "try http://" in r.output, r.output


@pytest.mark.parametrize("command", [["lora", "list"], ["complete", "-q", "Hi"]])
def test_bad_tls_files_are_usage_errors(tmp_path: Path, command: list[str]) -> None:
    key, cert = self_signed(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    url = ["--url", "https://127.0.0.1:9"]  # never reached: the options fail first
    cases = [
        (["--ca-certs", str(tmp_path / "nope.pem")], "'--ca-certs'"),
        (["--ca-certs", str(junk)], "--ca-certs"),
        (["--client-cert", str(junk)], "--client-cert"),
        (["--client-cert", str(cert)], "--client-cert"),  # no key in that file, none given
        (["--client-key", str(key)], "--client-key needs --client-cert"),
        (["--insecure", "--ca-certs", str(cert)], "contradict"),
    ]
    for flags, message in cases:
        r = run(command[0], *url, *command[1:], *flags)
        assert r.exit_code == 2, (flags, r.output)
        assert message in r.output and "Traceback" not in r.output, (flags, r.output)
