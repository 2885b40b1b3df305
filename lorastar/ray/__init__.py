"""lorastar replicas on Ray Serve, routed by adapter (``pip install 'lorastar[ray]'``).

>>> from ray import serve
>>> from lorastar.ray import build_app
>>> from lorastar.plugin import LoraStarConfig
>>> serve.run(build_app(LoraStarConfig(adapter_root="adapters/"), num_replicas=2))

Two deployments: ``LoraStarIngress`` (thin, no engine) reads ``model`` from the JSON body and
forwards the request through a streaming handle with ``multiplexed_model_id=model``;
``LoraStarReplica`` (``num_replicas`` of them) runs the engine and the plugin's OpenAI routes and
loads adapters from ``adapter_root`` on first use with ``@serve.multiplexed``
(``max_num_models_per_replica = engine.max_loras``, LRU eviction unloads from the engine). Ray's
router sends an adapter's requests to replicas that already hold it.

Why not ``ray.serve.llm``: importing it fails without vLLM or SGLang installed (its OpenAI
protocol models are vLLM's/SGLang's), and its ``LLMServer`` drives a vLLM engine. lorastar ships
its own OpenAI routes, so it uses plain Serve deployments and only Serve's multiplexing.
"""

from __future__ import annotations

from lorastar.ray.app import build_app

__all__ = ["build_app"]
