"""Tool-call parsers: function calls in a chat answer's text become OpenAI ``tool_calls`` (vLLM's
``--enable-auto-tool-choice --tool-call-parser``; ``tool_choice: "auto"``).

* ``hermes``: Hermes 2/3, Qwen2.5, Qwen3, SmolLM3 and the fine-tunes of their templates write each call
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The content is the text before the
  first call (None when there is none); the calls are every such block, the last one possibly
  unclosed (the answer ended at it).
* ``llama3_json``: Llama 3.1-3.3 (and their fine-tunes) answer a call with JSON alone,
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``, after an
  optional ``<|python_tag|>``. An answer is calls when it opens with ``{`` or that tag (vLLM's rule for
  streams; its whole-answer parser also tries JSON further in, which would take an answer quoting
  JSON in prose for a call): then it must be nothing but such objects.
* ``mistral``: Mistral's models (7B v0.3, Nemo, Small 3.x, Ministral 3, Devstral) open calls with the
  ``[TOOL_CALLS]`` control token: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` in the older
  tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` (or ``name{...}``) per call in v11+. The content is the
  text before the first one. Call ids are 9 letters and digits: Mistral's templates refuse others when
  the call comes back in the history.

* ``qwen3_coder``: Qwen3-Coder writes ``<tool_call><function=NAME><parameter=P>value</parameter>...``
  with every value as text; each is typed by the request's tool schema (``Qwen3CoderParser``).

* ``pythonic``: Llama 3.2 / 4 and others answer ``[f(a=1), g()]``, a Python list of calls
  (``PythonicParser``).

Control tokens such as ``[TOOL_CALLS]`` and ``<|python_tag|>`` are dropped from the text by default, so
a request parsed for tools is detokenized with ``skip_special_tokens=False`` (vLLM does the same).

Where the text is no such call (JSON that does not parse, no ``name``), the whole answer stays content,
as vLLM does, so nothing the model wrote is lost.

Streams hold back from where calls may begin and send the calls, whole, in the choice's last delta (one
``tool_calls`` entry each, arguments complete): OpenAI clients concatenate a call's argument pieces, so
one piece is a valid stream, and the stream's content and calls are exactly the whole answer's.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from lorastar.plugin.reasoning import held_tail

START, END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
Tools = list[Any] | None  # a request's OpenAI tool definitions
REQUIRED = "required"  # the parser of tool_choice "required" (not a --tool-call-parser choice)
REQUIRED_MISTRAL = "required_mistral"  # the same on a mistral server: its calls take Mistral's ids
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str


# A model may write JSON or Python escapes of lone UTF-16 surrogates ("\\ud800"): parsed, they are
# characters no UTF-8 response can carry (a 500 when it is encoded).
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# What parsing a model's text may raise besides ValueError: JSON nested deeper than Python's
# recursion limit (a degenerate answer, "[[[[..."), which must stay content, not fail the request.
_DEPTH = (RecursionError, MemoryError)


def _arguments(value: Any) -> str:
    """Arguments as OpenAI's JSON text (non-ASCII kept as written; a lone surrogate as its JSON
    escape, which keeps the meaning inside a JSON string, the only place one can be). A string is
    passed as written where it is JSON text already, else as a JSON string (vLLM's): arguments are
    always JSON, which clients parse and send back in the history."""
    text = value if isinstance(value, str) and _is_json(value) else json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, *_DEPTH):
        return False
    return True


def _call(obj: Any, make_id: Any = None) -> ParsedToolCall | None:
    """``{"name", "arguments" | "parameters"}`` as a call, or None when it is no such object (or
    its name is no text a response can carry)."""
    if not isinstance(obj, dict) or not isinstance(name := obj.get("name"), str) or _SURROGATE.search(name):
        return None
    try:
        args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    except _DEPTH:
        return None
    return ParsedToolCall(name, args, (make_id or _openai_id)())


def _openai_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def call_id(parser: str | None) -> str:
    """A new call id in ``parser``'s form (Mistral's 9 characters; OpenAI's otherwise)."""
    return _mistral_id() if parser == "mistral" else _openai_id()


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        """A whole answer's (content, calls); no calls: (the text, []). ``tools``: the request's
        (a parser whose format writes arguments untyped reads their types there)."""
        ...

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        """Where calls begin in the unsent text ``buf`` (None: not there), and how much of its end
        to hold back otherwise; ``at_start``: nothing of the answer has been sent yet."""
        ...


class HermesParser:
    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(START)
        if start < 0:
            return text, []
        calls: list[ParsedToolCall] = []
        for block in _BLOCK.findall(text, start):
            try:
                call = _call(json.loads(block))
            except (ValueError, *_DEPTH):
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return text[:start] or None, calls

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        start = buf.find(START)
        return (start, 0) if start >= 0 else (None, 0 if final else held_tail(buf, START))


def _opens_with(buf: str, final: bool, at_start: bool, opener: str, tag: str) -> tuple[int | None, int]:
    """``calls_start`` of formats whose answer is calls only when it opens with ``opener`` or
    ``tag`` (after whitespace)."""
    if not at_start:
        return None, 0  # content already went out: this answer is no call
    s = buf.lstrip()
    if s.startswith((opener, tag)):
        return 0, 0
    if not final and tag.startswith(s):
        return None, len(buf)  # whitespace or a partial tag so far: not decided yet
    return None, 0


class Llama3JsonParser:
    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        s = text.lstrip()
        s = s[len(PYTHON_TAG) :].lstrip() if s.startswith(PYTHON_TAG) else s
        if not s.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(s) and (s[i].isspace() or s[i] == ";"):
                i += 1
            if i == len(s):
                return None, calls
            try:
                obj, i = decoder.raw_decode(s, i)
            except (ValueError, *_DEPTH):
                return text, []
            call = _call(obj)
            if call is None or ("arguments" in obj and "parameters" in obj):
                return text, []
            calls.append(call)

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        return _opens_with(buf, final, at_start, "{", PYTHON_TAG)


class MistralParser:
    TAG = "[TOOL_CALLS]"

    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        if self.TAG not in text:
            return text, []
        content, *segments = text.split(self.TAG)
        calls: list[ParsedToolCall] = []
        for seg in segments:
            got = self._segment(seg.strip())
            if got is None:
                return text, []
            calls += got
        return ((content or None), calls) if calls else (text, [])

    def _segment(self, s: str) -> list[ParsedToolCall] | None:
        """One ``[TOOL_CALLS]`` body's calls (none for an empty one), or None when it is no call."""
        if not s:
            return []
        decoder = json.JSONDecoder()
        if s.startswith("["):  # before v11: a JSON array of {"name", "arguments"}
            try:
                arr, end = decoder.raw_decode(s)
            except (ValueError, *_DEPTH):
                return None
            calls = [_call(o, _mistral_id) for o in arr] if isinstance(arr, list) else [None]
            return None if s[end:].strip() or any(c is None for c in calls) else calls  # type: ignore[return-value]
        brace = s.find("{")  # v11+: name[ARGS]{...}
        # v11's templates may write the call's id too: name[CALL_ID]id[ARGS]{...} (not the name's)
        name = s[:brace].removesuffix("[ARGS]").partition("[CALL_ID]")[0].strip() if brace > 0 else ""
        if not name or any(c.isspace() for c in name):
            return None
        try:
            args, end = decoder.raw_decode(s, brace)
        except (ValueError, *_DEPTH):
            return None
        if s[end:].strip() or not isinstance(args, dict):
            return None
        call = _call({"name": name, "arguments": args}, _mistral_id)
        return [call] if call is not None else None

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        start = buf.find(self.TAG)
        return (start, 0) if start >= 0 else (None, 0 if final else held_tail(buf, self.TAG))


class Qwen3CoderParser:
    """Qwen3-Coder (and its fine-tunes) write each call as XML, every argument as plain text::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    The content is the text before the first call. Each value is typed by the request's tool
    schema as vLLM's ``qwen3_coder`` parser does: ``null`` is null; strings stay text; integer and
    number types parse as numbers, booleans as ``true``; objects and arrays as JSON (or a Python
    literal); a value that does not parse, or a parameter the schema lacks, stays text."""

    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
    _FUNCTION = re.compile(r"<function=(.*?)(?:</function>|\Z)", re.DOTALL)
    _PARAM = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)

    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(START)
        if start < 0:
            return text, []
        calls: list[ParsedToolCall] = []
        for block in self._CALL.findall(text, start):
            for fn in self._FUNCTION.findall(block):
                name, sep, body = fn.partition(">")
                name = name.strip()
                if not sep or not name:
                    return text, []
                props = _properties(tools, name)
                args: dict[str, Any] = {}
                for param in self._PARAM.findall(body):
                    key, sep, value = param.partition(">")
                    if not sep or not key.strip():
                        return text, []
                    value = value[1:] if value.startswith("\n") else value
                    value = value[:-1] if value.endswith("\n") else value
                    args[key.strip()] = _typed(value, props.get(key.strip()))
                calls.append(ParsedToolCall(name, _arguments(args), _openai_id()))
        return (text[:start] or None, calls) if calls else (text, [])

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        start = buf.find(START)
        return (start, 0) if start >= 0 else (None, 0 if final else held_tail(buf, START))


def _properties(tools: Tools, name: str) -> dict[str, Any]:
    """The JSON-schema properties of the request's tool ``name`` ({} where it has none)."""
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _typed(value: str, spec: Any) -> Any:
    """``value`` as its schema ``spec`` types it (vLLM's qwen3_coder conversion; text otherwise)."""
    if value.lower() == "null":
        return None
    kind = spec.get("type", "string") if isinstance(spec, dict) else "string"
    if isinstance(kind, list):  # a union ("type": ["integer", "null"]): its first type but null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float", "double")):
            number = float(value)
            if not math.isfinite(number):
                return value  # no JSON number
            return int(number) if number.is_integer() else number
        if kind.startswith("bool"):
            return value.strip().lower() == "true"
        if kind in ("object", "array", "dict", "list") or kind.startswith(("object", "array")):
            try:
                obj = json.loads(value)
            except ValueError:
                obj = ast.literal_eval(value)
            json.dumps(obj, allow_nan=False)  # JSON, finite (else ValueError / TypeError: kept as text)
            return obj
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return value


class PythonicParser:
    """Llama 3.2 / 4 and other pythonic-call models answer a call as a Python list of calls,
    ``[get_weather(city="Paris"), get_time()]``, optionally after ``<|python_start|>`` and before
    ``<|python_end|>`` (vLLM's ``pythonic`` parser). Keyword values are Python literals. An answer is
    calls only when it opens with ``[`` (or the tag) and is nothing but that list."""

    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        s = text.strip()
        s = s.removeprefix(self.START).removesuffix(self.END).strip()
        if not s.startswith("["):
            return text, []
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = []
            for call in tree.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                    return text, []
                args = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
                if len(args) != len(call.keywords):
                    return text, []  # **kwargs
                json.dumps(args, allow_nan=False)  # no Infinity: not JSON (ValueError)
                calls.append(ParsedToolCall(call.func.id, _arguments(args), _openai_id()))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return text, []
        return None, calls

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        return _opens_with(buf, final, at_start, "[", self.START)


class RequiredParser:
    """``tool_choice: "required"``'s answer, decoded under the tools' JSON schema (vLLM's):
    ``[{"name": ..., "parameters": {...}}, ...]``, calls from its first character; ids by ``make_id``."""

    def __init__(self, make_id: Any = None) -> None:
        self.make_id = make_id

    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedToolCall]]:
        try:
            objs = json.loads(text)
        except (ValueError, *_DEPTH):
            return text, []  # cut short (max_tokens): the text stays content
        calls = [_call(o, self.make_id) for o in objs] if isinstance(objs, list) and objs else [None]
        if any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]

    def calls_start(self, buf: str, final: bool, at_start: bool) -> tuple[int | None, int]:
        return 0, 0


PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
    "qwen3_coder": Qwen3CoderParser(),
    "pythonic": PythonicParser(),
}
TOOL_CALL_PARSERS = tuple(PARSERS)  # --tool-call-parser's choices
PARSERS[REQUIRED] = RequiredParser()
PARSERS[REQUIRED_MISTRAL] = RequiredParser(_mistral_id)


def parse_tool_calls(
    text: str, parser: str = "hermes", tools: Tools = None
) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole answer's (content, calls) by ``parser``; no calls: (the text, [])."""
    return PARSERS[parser].parse(text, tools)


class ToolCallStream:
    """One choice's streamed content, fed in deltas: content passes until calls may begin; from there
    everything is held and parsed when the choice ends."""

    def __init__(self, parser: str = "hermes", tools: Tools = None) -> None:
        self.parser = PARSERS[parser]
        self.tools = tools
        self.buf = ""
        self.in_calls = False
        self.at_start = True

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """The content this delta adds, and (with ``final``) the answer's calls."""
        buf = self.buf + text
        out = ""
        if not self.in_calls:
            start, keep = self.parser.calls_start(buf, final, self.at_start)
            if start is not None:
                out, buf, self.in_calls = buf[:start], buf[start:], True
            else:
                keep = 0 if final else keep
                out, buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.at_start = self.at_start and not out
        self.buf = "" if final else buf
        if not (final and self.in_calls):
            return out, []
        content, calls = self.parser.parse(buf, self.tools)
        return (out, calls) if calls else (out + buf, [])
