"""Budgets of the property tests (hypothesis), one switch for long random campaigns.

In CI and ``make test`` each property test runs its own fixed number of cases, derandomized where
it says so (a CI failure then replays the same way). ``LORASTAR_FUZZ=K`` (``make fuzz``) runs K
times as many cases, freshly random every run and with no example database: the way to look for
new failures on a quiet machine. Campaigns like that found a stalled pair of beam searches and
``/tokenize`` answering 500; the failing case hypothesis prints is then pinned in a test.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

FUZZ = int(os.environ.get("LORASTAR_FUZZ") or 0)


def budget(examples: int, *, derandomize: bool = True, **kw: Any) -> settings:
    """``settings`` for a property test that runs ``examples`` cases in CI (``derandomize``: the
    same cases every run) and ``examples * LORASTAR_FUZZ`` random ones in a campaign. No deadline
    and no health checks: the cases run whole engines on a shared CPU."""
    opts: dict[str, Any] = {"deadline": None, "suppress_health_check": list(HealthCheck), **kw}
    if FUZZ > 0:
        opts.update(max_examples=examples * FUZZ, derandomize=False, database=None)
    else:
        opts.update(max_examples=examples, derandomize=derandomize)
    return settings(**opts)
