"""Review of the new serve flags: TLS options that pass the up-front checks yet leave the server
unusable, or fail with an unreadable message."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_serve_tls_access_log import self_signed

from lorastar.plugin import cli
from lorastar.plugin.cli import main


def test_client_certs_required_without_a_ca_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--ssl-cert-reqs 2`` (or 1) with no ``--ssl-ca-certs``: uvicorn's context then trusts no
    CA, so every client's handshake fails (the server starts and refuses everyone). It should be a
    usage error, as the other TLS flag mistakes are."""
    (tmp_path / "config.json").write_text("{}")
    keyfile, certfile = self_signed(tmp_path)
    started: list[bool] = []

    def fake_run(app: Any, sock: socket.socket, log_level: str, **kw: Any) -> None:
        started.append(True)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    r = CliRunner().invoke(
        main,
        ["serve", str(tmp_path), "--port", "0", "--ssl-keyfile", str(keyfile),
         "--ssl-certfile", str(certfile), "--ssl-cert-reqs", "2"],
    )  # fmt: skip
    assert r.exit_code == 2 and not started, r.output
    assert "--ssl-ca-certs" in r.output, r.output


def test_a_passphrase_protected_key_gets_a_clear_error(tmp_path: Path) -> None:
    """An encrypted key: OpenSSL's prompt ('Enter PEM pass phrase:', twice, then uvicorn's again),
    and without a terminal 'cannot load them: [Errno 22] Invalid argument'. Run without a
    controlling terminal (a new session) so that no prompt can block."""
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    (tmp_path / "config.json").write_text("{}")
    keyfile, certfile = self_signed(tmp_path)
    key = serialization.load_pem_private_key(keyfile.read_bytes(), None)
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    code = (
        "from click.testing import CliRunner\n"
        "from lorastar.plugin.cli import main\n"
        f"r = CliRunner().invoke(main, ['serve', {str(tmp_path)!r}, '--port', '0', '--ssl-keyfile', "
        f"{str(keyfile)!r}, '--ssl-certfile', {str(certfile)!r}])\n"
        "print('EXIT', r.exit_code)\n"
        "print(r.output)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert "EXIT 2" in out, out
    assert "Enter PEM pass phrase" not in out, out
    assert "pass" in p.stdout.lower() or "encrypted" in p.stdout.lower(), out
