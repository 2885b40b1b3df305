"""Tool-call parsers: function calls in a chat answer's text become OpenAI ``tool_calls`` (vLLM's
``--enable-auto-tool-choice --tool-call-parser``; ``tool_choice: "auto"``).

``hermes``: Hermes 2/3, Qwen2.5, Qwen3, SmolLM3 and the fine-tunes of their templates write each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The content is the text before the first
call (None when there is none); the calls are every such block, the last one possibly unclosed (the
answer ended at it). A block that is no such JSON object leaves the whole answer as content, as vLLM
does, so nothing the model wrote is lost.

Streams hold back from the first ``<tool_call>`` on and send the calls, whole, in the choice's last
delta (one ``tool_calls`` entry each, arguments complete): OpenAI clients concatenate a call's
argument pieces, so one piece is a valid stream, and the stream's content and calls are exactly the
whole answer's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str

    @staticmethod
    def new(name: str, arguments: str) -> ParsedToolCall:
        return ParsedToolCall(name, arguments, f"chatcmpl-tool-{uuid.uuid4().hex}")


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole answer's (content, calls); no calls: (the text, [])."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls: list[ParsedToolCall] = []
    for block in _BLOCK.findall(text, start):
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ParsedToolCall.new(obj["name"], args))
    return text[:start] or None, calls


def _held(text: str) -> int:
    """Length of the longest tail of ``text`` that may still become ``<tool_call>``."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """One choice's streamed content, fed in deltas: content passes until a call may start; from the
    first ``<tool_call>`` on everything is held and parsed when the choice ends."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_calls = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """The content this delta adds, and (with ``final``) the answer's calls."""
        buf = self.buf + text
        out = ""
        if not self.in_calls:
            start = buf.find(START)
            if start >= 0:
                out, buf, self.in_calls = buf[:start], buf[start:], True
            else:
                keep = 0 if final else _held(buf)
                out, buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.buf = buf
        if not final or not self.in_calls:
            if final:
                self.buf = ""
            return out, []
        self.buf = ""
        content, calls = parse_tool_calls(buf)
        return (out, calls) if calls else (out + buf, [])
