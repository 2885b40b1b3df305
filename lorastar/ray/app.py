"""``build_app``: the Ray Serve application (ingress + replicas) for one ``LoraStarConfig``."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from lorastar.plugin import LoraStarConfig
from lorastar.plugin.service import LoraStarService
from lorastar.ray.ingress import LoraStarIngress
from lorastar.ray.replica import replica_class

logger = logging.getLogger("lorastar")


def default_actor_options(config: LoraStarConfig) -> dict[str, Any]:
    """One GPU per replica when the engine runs on CUDA, else one CPU. ``device="auto"`` (the
    default) takes a GPU when the Ray cluster has one (or, before ``ray.init``, this machine does):
    Ray hides every GPU from an actor that asked for none, so an "auto" replica given one CPU ran
    on the CPU of a GPU cluster without a word."""
    device = config.engine.device
    if device == "auto":
        device = "cuda" if _gpus_visible() else "cpu"
        logger.info(
            "lorastar.ray: engine.device='auto': replicas take one %s each (set engine.device or "
            "ray_actor_options to choose)", "GPU" if device == "cuda" else "CPU and no GPU",
        )  # fmt: skip
    return {"num_gpus": 1} if device == "cuda" else {"num_cpus": 1}


def _gpus_visible() -> bool:
    """Whether the Ray cluster (once started; else this machine) has a GPU."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def build_app(
    config: LoraStarConfig,
    num_replicas: int = 1,
    *,
    routing: str = "multiplexed",
    ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
) -> Application:
    """``num_replicas`` engines behind one ingress; ``serve.run(app)`` serves them on Serve's proxy.

    Each replica holds at most ``config.engine.max_loras`` adapters from ``config.adapter_root``
    (loaded on first use, LRU-evicted); ``config.adapters`` are loaded on every replica at start.
    ``routing="adapter_blind"`` ignores adapters when routing (a baseline for benchmarks).
    """
    if not isinstance(config, LoraStarConfig):
        raise TypeError(f"config must be a LoraStarConfig, got {type(config).__name__}")
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    base_names = LoraStarService(config).served_model_names
    replica_options: dict[str, Any] = {
        "num_replicas": num_replicas,
        "ray_actor_options": ray_actor_options or default_actor_options(config),
    }
    if max_ongoing_requests is not None:
        replica_options["max_ongoing_requests"] = max_ongoing_requests
    replica = serve.deployment(replica_class(config.engine.max_loras)).options(
        name="LoraStarReplica", **replica_options
    )
    ingress = serve.deployment(LoraStarIngress).options(
        name="LoraStarIngress", ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(replica.bind(config), [*base_names, *config.adapters], routing)
