"""``AdapterInfo``: one registered adapter as the registry reports it, and ``check_name``, the rule
for an adapter's name. Torch-free (unlike the registry), for the frontend of an engine core in
another process, which decodes these, and for the admin route, which checks a name before any load."""

from __future__ import annotations

from dataclasses import dataclass

from lorastar.errors import AdapterError


@dataclass(frozen=True)
class AdapterInfo:
    """One registered name, as ``list()`` reports it (the admin route and ``/v1/models`` use this)."""

    name: str
    path: str
    rank: int
    content_hash: str
    target_modules: tuple[str, ...]
    tier: str  # "device" | "cpu" | "disk"
    slot: int | None
    in_flight: int


def check_name(name: object) -> str:
    """``name`` if it can name an adapter (a non-empty string, no whitespace or '/'), else AdapterError."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
    if any(c.isspace() for c in name) or "/" in name:
        raise AdapterError(f"adapter name {name!r} must not contain whitespace or '/'")
    return name
