"""Message content as the chat template reads it: a string, or OpenAI's list of parts.

Templates of multimodal families (Gemma 3, Mistral 3, SmolVLM, Llama 4) loop over
``message['content']`` as a list of ``{"type": "text", "text": ...}`` parts; text-only ones print it
as a string. vLLM detects which from the template's syntax tree (``chat_template_content_format``
"auto") and hands each template what it reads: a string template gets the text parts joined with
"\\n", a list template gets the parts (a string content becomes one text part). Given a string, a
list template rendered each part separator of its own (Gemma 3: parts concatenated, each trimmed)
differently, and one with no string branch (SmolVLM) iterated the string's characters and rendered
the message empty.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from typing import Any, Literal

from lorastar.errors import InvalidParamError

ContentFormat = Literal["string", "openai"]

# vLLM's text part types (a refusal's text is its ``refusal``)
TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """``node`` reads variable ``name`` (``key``: its item ``name[key]`` / ``name.key``), possibly
    through filters, tests and slices (``messages[1:]``, ``message['content'] | list``)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, nodes.Getitem):
            hit = isinstance(node.arg, nodes.Const) and node.arg.value == key
        elif isinstance(node, nodes.Getattr):
            hit = node.attr == key
        else:
            return False
        node = node.node
        if not hit:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _aliases(root: Any, name: str) -> list[str]:
    """``name`` and the variables ``{% set %}`` binds to it (or to its slices, filtered forms)."""
    from jinja2 import nodes

    names, todo = [name], deque([name])
    while todo:
        cur = todo.popleft()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, cur):
                names.append(target.name)
                todo.append(target.name)
    return names


def _loop_targets(root: Any, names: list[str], key: str | None = None) -> Iterator[str]:
    """The loop variables of ``{% for x in n %}`` (``key``: ``in n[key]``) over any of ``names``."""
    from jinja2 import nodes

    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, n, key) for n in names):
            yield loop.target.name


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """``"openai"`` where ``template`` loops over a message's ``content`` (a list of parts), else
    ``"string"`` (also for a template jinja cannot parse: rendering it will say why)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - the render reports a broken template
        return "string"
    message_vars = list(_loop_targets(tree, _aliases(tree, "messages")))
    return "openai" if next(_loop_targets(tree, message_vars, "content"), None) else "string"


def _part_text(part: Any, where: str) -> str | None:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        raise InvalidParamError("messages", f"{where}: only text parts are supported, got {kind!r}")
    text = part.get("refusal" if kind == "refusal" else "text")
    if text is not None and not isinstance(text, str):
        raise InvalidParamError("messages", f"{where}: a {kind} part's text must be a string")
    return text  # None: skipped, as vLLM skips a text part without its text


def template_content(content: Any, fmt: ContentFormat, index: int) -> str | list[dict[str, str]]:
    """A message's ``content`` (a string, ``None``, or a list of text parts) as a template of
    format ``fmt`` reads it: the texts joined with "\\n", or one ``{"type": "text"}`` part each."""
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        if fmt == "string":
            return content
        texts = [content]
    elif isinstance(content, list):
        got = (_part_text(p, f"messages[{index}].content[{j}]") for j, p in enumerate(content))
        texts = [t for t in got if t is not None]
    else:
        raise InvalidParamError("messages", f"messages[{index}].content must be a string or a list of parts")
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def texts_of(content: Any) -> list[str]:
    """The strings in a message's ``content`` (for the prompt-size check before rendering)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [t for p in content if isinstance(t := p.get("text") if isinstance(p, dict) else p, str)]
    return []
