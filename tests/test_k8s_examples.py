"""examples/k8s/: the manifests parse, and every route, port, flag and metric they name is one
lorastar serves (read from the CLI, the app and a metrics render, not from a second list)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parents[1] / "examples" / "k8s"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _app_paths() -> set[str]:
    from lorastar.plugin import LoraStarConfig, create_app

    app = create_app(LoraStarConfig())  # routes only: the engine starts with the lifespan
    return {r.path for r in app.routes}


def _metric_names() -> set[str]:
    from lorastar.engine.metrics import EngineStats, TokenHistogram
    from lorastar.plugin.metrics import PluginMetrics

    stats = EngineStats(1, 0, 0.5, 10, 5, 0, 4, 2, 4, 3, 2, {"a": {"running": 1, "waiting": 0}},
                        adapter_tiers={"a": "device"}, iteration_tokens=TokenHistogram())  # fmt: skip
    text = PluginMetrics(lambda: stats, lambda: "m", lambda: 2).render().decode()
    return set(re.findall(r"^([a-z_:]+)", text, re.M))


def test_deployment_service_and_probes_name_what_lorastar_serves() -> None:
    from lorastar.plugin.cli import main

    (dep,) = _docs("deployment.yaml")
    (svc,) = _docs("service.yaml")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    assert args[0] == "serve"
    serve = main.commands["serve"]  # type: ignore[attr-defined]
    flags = {opt for p in serve.params for opt in getattr(p, "opts", [])}
    for a in args[1:]:
        if a.startswith("--"):
            assert a in flags, f"lorastar serve has no {a}"
    port = int(args[args.index("--port") + 1])
    assert c["ports"][0]["containerPort"] == port
    paths = _app_paths()
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["port"] == port and get["path"] in paths
    ann = pod["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == port and ann["prometheus.io/path"] in paths
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == port
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_gateway_manifests_point_at_the_pods_and_metrics_that_exist() -> None:
    (dep,) = _docs("deployment.yaml")
    (svc,) = _docs("service.yaml")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    port = dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    pool, model = _docs("gie.yaml")
    assert pool["kind"] == "InferencePool" and model["kind"] == "InferenceModel"
    assert pool["spec"]["targetPortNumber"] == port
    assert pool["spec"]["selector"].items() <= labels.items()
    assert model["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert {t["name"] for t in model["spec"]["targetModels"]} == {model["spec"]["modelName"]}
    (values,) = _docs("production-stack-values.yaml")
    router = values["routerSpec"]
    m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", router["staticBackends"])
    assert m and m.group(1) == svc["metadata"]["name"] and int(m.group(2)) == svc["spec"]["ports"][0]["port"]
    served = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router["staticModels"] == served[served.index("--served-model-name") + 1]
    # Every metric the files mention is one lorastar exposes.
    exposed = _metric_names()
    mentioned = set()
    for f in K8S.iterdir():
        mentioned |= set(re.findall(r"vllm:[a-z_]+", f.read_text()))
    assert mentioned and mentioned <= exposed, mentioned - exposed
