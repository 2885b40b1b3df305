"""``AdapterInfo``: one registered adapter as the registry reports it; torch-free (unlike the
registry), for the frontend of an engine core in another process, which decodes these."""

from __future__ import annotations

from dataclasses import dataclass


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
