"""``lorastar chat`` / ``lorastar complete`` (vLLM's terminal clients) against the live tiny-model
server: streamed answers equal the offline engine's greedy ones; ``chat`` keeps the conversation."""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner

from lorastar.plugin.cli import main

PROMPT = "The capital of France is"


def greedy(max_tokens: int) -> Any:
    from lorastar import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_complete_quick_with_an_adapter_and_the_default_model(real_server: Any, offline_llm: Any) -> None:
    r = CliRunner().invoke(
        main, ["complete", "--url", real_server.url, "--model-name", "alpha", "-q", PROMPT,
               "--temperature", "0", "--max-tokens", "8"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output == offline_llm.generate(PROMPT, greedy(8), adapter="alpha")[0].outputs[0].text + "\n"
    # no --model-name: the server's first model, the base; the URL given with /v1 this time
    r = CliRunner().invoke(
        main,
        [
            "complete",
            "--url",
            real_server.url + "/v1",
            "-q",
            PROMPT,
            "--temperature",
            "0",
            "--max-tokens",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output == offline_llm.generate(PROMPT, greedy(5))[0].outputs[0].text + "\n"


def test_chat_keeps_the_conversation(real_server: Any, offline_llm: Any) -> None:
    args = [
        "chat",
        "--url",
        real_server.url,
        "--model-name",
        "alpha",
        "--temperature",
        "0",
        "--max-tokens",
        "6",
    ]
    r = CliRunner().invoke(main, [*args, "--system-prompt", "Be brief."], input="Hi\n\nName three colours.\n")
    assert r.exit_code == 0, r.output
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want1 = offline_llm.chat(conversation, greedy(6), adapter="alpha")[0].outputs[0].text
    conversation += [
        {"role": "assistant", "content": want1},
        {"role": "user", "content": "Name three colours."},
    ]
    want2 = offline_llm.chat(conversation, greedy(6), adapter="alpha")[0].outputs[0].text
    assert r.output == f"{want1}\n{want2}\n"  # the blank line sent nothing


def test_errors_are_one_line(real_server: Any) -> None:
    r = CliRunner().invoke(main, ["chat", "--url", real_server.url, "--model-name", "nobody", "-q", "hi"])
    assert r.exit_code == 1 and "404: The model `nobody` does not exist." in r.output, r.output
    r = CliRunner().invoke(main, ["complete", "--url", "http://127.0.0.1:9", "-q", "hi"])
    assert (
        r.exit_code == 1 and "cannot reach http://127.0.0.1:9/v1" in r.output and "Traceback" not in r.output
    )
