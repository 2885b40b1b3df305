"""``make demo``: start examples/app.py with uvicorn on 127.0.0.1, ask the base model and every demo
adapter the same kind of question with the official ``openai`` client (one answer streamed), print
the answers side by side, stop the server.

    python examples/client_demo.py [--port N] [--max-tokens N] [--question Q]
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent

# One question for every model, so the answers compare side by side (each demo adapter's trained
# behaviour — upper case, pirate speak, a JSON object — shows on any question).
DEFAULT_QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early (code {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not become healthy within {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--question", default=DEFAULT_QUESTION)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args()

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    token = secrets.token_hex(8)  # enables the admin routes for this run (shown with the CLI below)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        LORASTAR_ADMIN_TOKEN=token,
    )
    print(f"starting examples/app.py on {url} (first run converts the embedded model once) ...", flush=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "examples.app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
    )
    try:
        wait_healthy(url, proc, args.startup_timeout)
        print(
            f"the app's own route still works: GET /books -> {httpx.get(url + '/books').json()[0]['title']}"
        )
        client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed")
        models = client.models.list().data
        base = next(m.id for m in models if not getattr(m, "parent", None))
        adapters = [m.id for m in models if getattr(m, "parent", None)]
        print(
            f"base model: {base}; adapters: {', '.join(adapters) or '(none found under examples/adapters)'}\n"
        )

        rows: list[tuple[str, str, str]] = []
        for i, model in enumerate([base, *adapters]):
            question = args.question
            messages = [{"role": "user", "content": question}]
            if i == 0:  # the base answer is streamed, printed as it arrives
                print(f"[{model}] (streamed) ", end="", flush=True)
                parts: list[str] = []
                stream = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        parts.append(chunk.choices[0].delta.content)
                        print(chunk.choices[0].delta.content, end="", flush=True)
                print("\n")
                answer = "".join(parts)
            else:
                r = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
                )
                answer = r.choices[0].message.content or ""
            rows.append((model, question, answer.strip()))

        width = max(len(r[0]) for r in rows)
        print("=" * 100)
        print(f"Q: {args.question}")
        print("-" * 100)
        for model, _question, answer in rows:
            lines = textwrap.wrap(answer.replace("\n", " ") or "(empty)", 100 - width - 3) or [""]
            print(f"{model.ljust(width)} | {lines[0]}")
            for line in lines[1:]:
                print(f"{''.ljust(width)} | {line}")
        print("=" * 100)
        print("\n$ lorastar lora --url", url + "/v1", "list", flush=True)
        subprocess.run(
            [sys.executable, "-m", "lorastar.plugin.cli", "lora", "--url", url + "/v1", "list"],
            cwd=REPO,
            env=env,
            check=False,
        )
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
