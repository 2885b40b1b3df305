"""Reasoning parsers: a thinking model's ``<think>...</think>`` goes to ``reasoning_content``, the
rest to ``content`` (vLLM's ``--reasoning-parser``, chat completions only).

Two styles, by where the thinking block opens:

* ``qwen3`` (Qwen3, SmolLM3, and their fine-tunes): the model writes ``<think>`` itself; output that
  does not open with it (``enable_thinking=False``: the template put an empty block in the prompt) is
  all content.
* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3-Thinking-2507): the template ends the
  prompt inside the block, so the output is reasoning from its first token (a ``<think>`` the model
  writes anyway is dropped) until ``</think>``; without one, all of it is reasoning.

The chat route reads the prompt first (vLLM's ``is_reasoning_end``; ``prompt_reasoning_style``): a
prompt ending in ``</think>`` (``enable_thinking=False``) makes the answer all content, one ending in
``<think>`` makes it reasoning from its first token, whichever the parser.

One incremental splitter serves streams and whole answers alike, so both give the same split: it
holds back only text that may still become a tag (``</thi`` at the end of a delta) and flushes it at
the end. Reasoning cut off by ``max_tokens`` stays reasoning.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def held_tail(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag`` (it may become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one choice's text, fed in deltas, into (reasoning, content) deltas."""

    def __init__(self, style: str) -> None:
        if style not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {style!r}; known: {', '.join(REASONING_PARSERS)}")
        self.style = style
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content" (qwen3)
        self.buf = ""  # text not yet emitted: the opening, or a tail that may be a tag
        self.reasoned = False  # entered the thinking block (the answer's reasoning is not None)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content this delta adds (either may be empty); ``final``: the last delta
        (everything held back is flushed)."""
        reasoning, content = "", ""
        buf = self.buf + text
        self.buf = ""
        if self.state == "start":
            opening = buf.lstrip()
            if opening.startswith(THINK_START):
                buf = opening[len(THINK_START) :]
                self.state = "reasoning"
            elif THINK_START.startswith(opening) and not final:
                self.buf = buf  # whitespace or a partial "<think>" so far: not decided yet
                return "", ""
            else:
                self.state = "reasoning" if self.style == "deepseek_r1" else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            end = buf.find(THINK_END)
            if end < 0:
                keep = 0 if final else held_tail(buf, THINK_END)
                reasoning, self.buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END) :]
            self.state = "content"
        content = buf
        return reasoning, content

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning_content, content), as vLLM returns them: reasoning None when
        the answer has no thinking block, content None when nothing follows it."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.reasoned else None), (content or None)
