"""``lorastar serve`` over HTTPS (``--ssl-keyfile`` / ``--ssl-certfile``) and without uvicorn's
access log (``--disable-uvicorn-access-log``), vLLM's flags; bad TLS flags fail before loading."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from plugin_support import free_port

from lorastar.plugin.cli import main


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, made with ``cryptography``."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    keyfile, certfile = folder / "key.pem", folder / "cert.pem"
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return keyfile, certfile


def test_https_without_access_log(tiny_model_dir: Path, tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", str(tiny_model_dir), "--served-model-name", "tiny",
         "--port", str(port), "--device", "cpu", "--no-engine-process", "--disable-log-stats",
         "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile), "--disable-uvicorn-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            try:
                if httpx.get(url + "/health", verify=str(certfile)).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
            verify=str(certfile),
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert f"listening on {url}/v1" in err
    # uvicorn's access lines ('"POST /v1/completions HTTP/1.1" 200') are off; its other lines stay.
    assert "HTTP/1.1" not in out + err, (out + err)[-3000:]
    assert "Application startup complete" in out + err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-ca-certs", "ca.pem"], "need --ssl-keyfile and --ssl-certfile"),
        (
            ["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"],
            "--ssl-keyfile '/no/key.pem' is not a file",
        ),
        (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
    ],
)
def test_bad_tls_flags_fail_before_loading(tmp_path: Path, flags: list[str], message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--port", "0", *flags])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    keyfile, _ = self_signed(tmp_path / "one")
    _, certfile = self_signed(tmp_path / "two")
    r = CliRunner().invoke(
        main,
        [
            "serve",
            str(tmp_path),
            "--port",
            "0",
            "--ssl-keyfile",
            str(keyfile),
            "--ssl-certfile",
            str(certfile),
        ],
    )
    assert r.exit_code == 2 and "cannot load them" in r.output, r.output
