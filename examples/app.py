"""An existing Litestar app (a tiny bookshop API) that mounts lorastar with the demo adapters.

Run it:

    uvicorn examples.app:app --port 8000          # or: litestar --app examples.app:app run
    litestar --app examples.app:app lora list     # the plugin's CLI group

Then talk to it with any OpenAI client at ``http://127.0.0.1:8000/v1``: ``model`` is the base
(``SmolLM2-135M-Instruct``) or an adapter name (every folder under ``examples/adapters/``).

Environment knobs (all optional): ``LORASTAR_MODEL`` (HF folder; default: the embedded SmolLM2),
``LORASTAR_ADAPTER_DIR`` (default: ``examples/adapters``), ``LORASTAR_ADMIN_TOKEN`` (enables the
adapter admin routes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from litestar import Litestar, get, post
from litestar.exceptions import NotFoundException

from lorastar.config import EngineConfig
from lorastar.engine.sampling import SamplingParams
from lorastar.plugin import LoraStarConfig, LoraStarPlugin

ADAPTER_DIR = Path(__file__).resolve().parent / "adapters"

BOOKS = {
    1: {"id": 1, "title": "Treasure Island", "author": "Robert Louis Stevenson"},
    2: {"id": 2, "title": "Moby-Dick", "author": "Herman Melville"},
}


def discover_adapters(root: Path) -> dict[str, str]:
    """Every PEFT folder directly under ``root`` (whatever the demo training produced so far)."""
    if not root.is_dir():
        return {}
    return {p.name: str(p) for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}


# --- the app's own routes: lorastar leaves them alone -------------------------------------------


@get("/")
async def index() -> dict[str, Any]:
    return {"service": "bookshop", "llm": "/v1 (OpenAI API)", "books": "/books"}


@get("/books")
async def list_books() -> list[dict[str, Any]]:
    return list(BOOKS.values())


def _book(book_id: int) -> dict[str, Any]:
    if book_id not in BOOKS:
        raise NotFoundException(f"no book {book_id}")
    return BOOKS[book_id]


@get("/books/{book_id:int}")
async def get_book(book_id: int) -> dict[str, Any]:
    return _book(book_id)


@post("/books/{book_id:int}/blurb", status_code=200)
async def blurb(book_id: int, lorastar_engine: Any, style: str | None = None) -> dict[str, Any]:
    """The app's own handler using the engine the plugin injects (``style``: an adapter name)."""
    book = _book(book_id)
    messages = [{"role": "user", "content": f"Write one sentence about the book {book['title']}."}]
    ids = lorastar_engine.apply_chat_template(messages)
    text = ""
    async for out in lorastar_engine.generate(
        ids, SamplingParams(max_tokens=40, temperature=0), adapter=style
    ):
        text = out.outputs[0].text
    return {"book": book["title"], "style": style or "base", "blurb": text}


def create_app(
    model: str | None = None,
    adapter_dir: str | Path | None = None,
    engine: EngineConfig | None = None,
    **config: Any,
) -> Litestar:
    """The bookshop app with lorastar mounted under ``/v1`` (tests build it with a tiny model)."""
    model = model or os.environ.get("LORASTAR_MODEL") or None
    root = Path(adapter_dir or os.environ.get("LORASTAR_ADAPTER_DIR") or ADAPTER_DIR)
    lorastar = LoraStarPlugin(
        LoraStarConfig(
            model=model,
            adapters=discover_adapters(root),
            adapter_root=root,
            engine=engine or EngineConfig(),
            **config,
        )
    )
    return Litestar(route_handlers=[index, list_books, get_book, blurb], plugins=[lorastar])


app = create_app()  # cheap: the model loads in the app's lifespan, not at import
