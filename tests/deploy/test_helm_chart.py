"""The Helm chart deploy/helm/glance: strict lint, rendering of every profile, strict Kubernetes validation of
every rendered object, the values schema, and the wiring a deployment depends on. Offline: the embedded Helm
engine (helm-python-sdk) renders, kubernetes-validate checks against its bundled schemas."""

from __future__ import annotations

import copy

import pytest
from tests.deploy.deploy_helpers import CHART, NAMESPACE, PROFILES, find, load_values, objects, render_docs

MIN_KUBE = (1, 33)  # "current": the schemas used must be at least this recent
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(scope="session")
def kube_version():
    kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is not installed")
    version = kv.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= MIN_KUBE, version
    return version


# ---------------------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", list(PROFILES))
def test_lint_strict(helm, kube_version, profile):
    report = helm.lint(CHART, load_values(PROFILES[profile]), strict=True, kube_version=f"v{kube_version}",
                       namespace=NAMESPACE)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == [], report
    # severity 2 = warning, 3 = error; strict mode fails on either. (1 = info: "icon is recommended".)
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# ---------------------------------------------------------------------------------------------------------
# rendering + Kubernetes validation
# ---------------------------------------------------------------------------------------------------------

# What each profile must produce (kind, name suffix); and what it must not.
EXPECTED = {
    "default": {
        ("Deployment", "-engine"), ("Deployment", "-gateway"), ("Service", "-engine"), ("Service", "-gateway"),
        ("ConfigMap", "-config"), ("HorizontalPodAutoscaler", "-gateway"), ("PodDisruptionBudget", "-gateway"),
        ("NetworkPolicy", "-engine"), ("NetworkPolicy", "-gateway"), ("ServiceAccount", ""),
        ("PersistentVolumeClaim", "-models"), ("Pod", "-test"),
    },
    "cpu-demo": {
        ("Deployment", "-gateway"), ("Service", "-gateway"), ("ConfigMap", "-config"),
        ("NetworkPolicy", "-gateway"), ("ServiceAccount", ""), ("Pod", "-test"),
    },
    "gpu": {
        ("Deployment", "-engine"), ("Deployment", "-gateway"), ("Service", "-engine"), ("Service", "-gateway"),
        ("ConfigMap", "-config"), ("Secret", "-api-key"), ("HorizontalPodAutoscaler", "-gateway"),
        ("PodDisruptionBudget", "-gateway"), ("PodDisruptionBudget", "-engine"), ("NetworkPolicy", "-engine"),
        ("NetworkPolicy", "-gateway"), ("ServiceAccount", ""), ("Pod", "-test"),
    },
    "all-on": {
        ("Deployment", "-engine"), ("Deployment", "-gateway"), ("Service", "-engine"), ("Service", "-gateway"),
        ("ConfigMap", "-config"), ("Secret", "-api-key"), ("HorizontalPodAutoscaler", "-gateway"),
        ("HorizontalPodAutoscaler", "-engine"), ("PodDisruptionBudget", "-gateway"),
        ("PodDisruptionBudget", "-engine"), ("NetworkPolicy", "-engine"), ("NetworkPolicy", "-gateway"),
        ("ServiceAccount", ""), ("ServiceMonitor", ""), ("Pod", "-test"),
    },
}
ABSENT = {
    "cpu-demo": {("Deployment", "-engine"), ("Service", "-engine"), ("PersistentVolumeClaim", ""),
                 ("HorizontalPodAutoscaler", ""), ("ServiceMonitor", "")},
    "gpu": {("PersistentVolumeClaim", ""), ("ServiceMonitor", "")},
    "all-on": {("PersistentVolumeClaim", "")},  # models from an NFS volume
}


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_renders_expected_objects(rendered, profile):
    docs = rendered[profile]
    for kind, suffix in EXPECTED[profile]:
        assert find(docs, kind, suffix), f"{profile}: no {kind} *{suffix}"
    for kind, suffix in ABSENT.get(profile, ()):
        assert not find(docs, kind, suffix), f"{profile}: unexpected {kind} *{suffix}"
    names = [(o["kind"], o["metadata"]["name"]) for o in objects(docs)]
    assert len(names) == len(set(names)), names
    for o in objects(docs):
        assert o["metadata"].get("namespace") in (NAMESPACE, None), o["metadata"]
        assert len(o["metadata"]["name"]) <= 63


def test_all_on_renders_every_template(rendered):
    """Every template produces an object with every option on (the PVC is the alternative to the volume)."""
    docs = rendered["all-on"]
    empty = sorted(name for name, objs in docs.items() if not objs and not name.endswith("engine-pvc.yaml"))
    assert empty == []
    assert rendered["default"]["glance/templates/engine-pvc.yaml"], "default values create the models claim"


def _servicemonitor_schema():
    """A strict schema for the parts of the Prometheus Operator CRD this chart uses."""
    s = {"type": "string", "minLength": 1}
    labels = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
            "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                         "properties": {"name": s, "namespace": s, "labels": labels, "annotations": labels}},
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object", "additionalProperties": False,
                                 "properties": {"matchLabels": labels}},
                    "namespaceSelector": {"type": "object", "additionalProperties": False,
                                          "properties": {"matchNames": {"type": "array", "items": s},
                                                         "any": {"type": "boolean"}}},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["port"],
                        "properties": {"port": s, "path": {"type": "string", "pattern": "^/"},
                                       "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                       "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
                },
            },
        },
    }


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_manifest_validates_strictly(rendered, kube_version, profile):
    import jsonschema
    from kubernetes_validate import utils as kv

    checked = 0
    for template, objs in rendered[profile].items():
        for obj in objs:
            if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
                jsonschema.validate(obj, _servicemonitor_schema())
                continue
            try:
                kv.validate(obj, kube_version, strict=True)
            except kv.ValidationError as e:  # pragma: no cover - the message is the point
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{profile} {template} {obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
            checked += 1
    assert checked >= len(EXPECTED[profile]) - 1


# ---------------------------------------------------------------------------------------------------------
# values.schema.json
# ---------------------------------------------------------------------------------------------------------


def _with(path: str, value):
    """Default values with one key (dotted path) replaced."""
    def build():
        vals: dict = {}
        node = vals
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        return vals
    return build


BAD_VALUES = {
    "unknown top-level key (typo)": _with("gatway", {"enabled": True}),
    "unknown nested key": _with("engine.speculative.treeBuget", 31),
    "backend not in enum": _with("gateway.backend", "vllm"),
    "port out of range": _with("engine.port", 70000),
    "block size as a string": _with("engine.speculative.blockSize", "16"),
    "block size too small": _with("engine.speculative.blockSize", 1),
    "tree budget zero": _with("engine.speculative.treeBudget", 0),
    "branch_k negative": _with("engine.speculative.branchK", -1),
    "zero GPUs": _with("engine.gpus", 0),
    "model storage source unknown": _with("engine.models.source", "s3"),
    "relative drafter path": _with("engine.models.drafterPath", "models/drafter"),
    "volume source without a volume": _with("engine.models.source", "volume"),
    "pull policy not in enum": _with("gateway.image.pullPolicy", "Sometimes"),
    "image tag latest": _with("engine.image.tag", "latest"),
    "malformed digest": _with("gateway.image.digest", "sha256:xyz"),
    "bad memory quantity": _with("gateway.resources.limits", {"memory": "2 gigs"}),
    "mem fraction above 1": _with("engine.memFractionStatic", 1.5),
    "upstream not a URL": _with("gateway.upstream", "engine:30000"),
    "secret name not a DNS name": _with("gateway.apiKey.existingSecret", "My_Secret"),
    "service type not in enum": _with("gateway.service.type", "Ingress"),
    "probe path relative": _with("engine.readinessProbe", {"path": "health", "periodSeconds": 10,
                                                            "timeoutSeconds": 5, "failureThreshold": 3}),
    "extraArgs not strings": _with("engine.extraArgs", [{"--tp": 2}]),
    "flag name without dashes": _with("engine.speculative.flags", {"blockSize": "block-size"}),
    "enabled as a string": _with("networkPolicy.enabled", "yes"),
    "config key not an env name": _with("config", {"bad-key": "1"}),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_schema_rejects_bad_values(helm, chart, case):
    values = BAD_VALUES[case]()
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
    # The same values stop a render (what `helm install` would do), and a strict lint reports an error.
    with pytest.raises(helm.HelmError):
        chart.render(values=values, name="glance", namespace=NAMESPACE)


def test_schema_accepts_every_profile(chart):
    for path in PROFILES.values():
        chart.validate_schema(load_values(path))


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"enabled": False}, "engine": {"enabled": False}}, "enable the gateway"),
    ({"engine": {"enabled": False}}, "needs engine.enabled=true or gateway.upstream"),
])
def test_inconsistent_values_fail_with_a_clear_message(helm, chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values=values, name="glance", namespace=NAMESPACE)


def test_lint_reports_bad_values(helm, kube_version):
    report = helm.lint(CHART, {"gateway": {"backend": "vllm"}}, strict=True, kube_version=f"v{kube_version}")
    assert report["errors"] or any(m["severity"] >= 2 for m in report["messages"])


# ---------------------------------------------------------------------------------------------------------
# wiring
# ---------------------------------------------------------------------------------------------------------


def _container(docs, suffix):
    (dep,) = find(docs, "Deployment", suffix)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, c


def _arg(args, flag):
    assert flag in args, (flag, args)
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("profile", ["default", "gpu", "all-on"])
def test_engine_launches_sglang_with_glance(rendered, profile):
    values = load_values(PROFILES[profile]) or {}
    chart_defaults = load_values(CHART / "values.yaml")
    spec = {**chart_defaults["engine"]["speculative"], **values.get("engine", {}).get("speculative", {})}
    models = {**chart_defaults["engine"]["models"], **values.get("engine", {}).get("models", {})}
    _, c = _container(rendered[profile], "-engine")
    assert c["command"] == ["python", "-m", "sglang.launch_server"]
    args = c["args"]
    line = " ".join(args)
    assert "--speculative-algorithm GLANCE" in line
    assert f"--speculative-draft-model-path {models['drafterPath']}" in line
    assert _arg(args, "--model-path") == models["targetPath"]
    # tree budget = speculative_num_draft_tokens - 1 (the root is verified too)
    assert int(_arg(args, "--speculative-num-draft-tokens")) == spec["treeBudget"] + 1
    assert all(isinstance(a, str) for a in args)
    port = int(_arg(args, "--port"))
    assert c["ports"][0] == {"name": "http", "containerPort": port, "protocol": "TCP"}
    env = {e["name"] for e in c.get("env", [])}
    assert "HOME" in env
    assert c["envFrom"][0]["configMapRef"]["name"].endswith("-config")


def test_engine_options_reach_the_command_line(rendered):
    docs = rendered["all-on"]
    _, c = _container(docs, "-engine")
    args = c["args"]
    assert _arg(args, "--speculative-glance-block-size") == "10"
    assert _arg(args, "--speculative-glance-branch-k") == "4"
    assert _arg(args, "--speculative-num-draft-tokens") == "64"
    assert _arg(args, "--tp-size") == "2"
    assert _arg(args, "--served-model-name") == "qwen2.5-vl-7b-glance"
    assert _arg(args, "--mem-fraction-static") == "0.85"
    assert _arg(args, "--attention-backend") == "flashinfer"
    assert "--disable-cuda-graph" in args and "--enable-metrics" in args
    assert args[-4:] == ["--log-level", "info", "--chunked-prefill-size", "8192"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    (cm,) = find(docs, "ConfigMap", "-config")
    assert cm["data"]["GLANCE_BLOCK_SIZE"] == "10" and cm["data"]["GLANCE_BRANCH_K"] == "4"
    assert cm["data"]["GLANCE_TREE_BUDGET"] == "63"
    # Default flags: block size and branch_k travel only through the ConfigMap's environment.
    _, c = _container(rendered["default"], "-engine")
    assert not any(a.startswith("--speculative-glance") for a in c["args"])


@pytest.mark.parametrize("profile", ["default", "gpu", "all-on"])
def test_engine_gpu_shm_and_read_only_models(rendered, profile):
    dep, c = _container(rendered[profile], "-engine")
    pod = dep["spec"]["template"]["spec"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["models"]["readOnly"] is True
    if "persistentVolumeClaim" in vols["models"]:
        assert vols["models"]["persistentVolumeClaim"]["readOnly"] is True
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600


def test_gpu_profile_scheduling(rendered):
    dep, _ = _container(rendered["gpu"], "-engine")
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "glance-models"


def test_image_source_mounts_no_models(chart):
    docs = render_docs(chart, {"engine": {"models": {"source": "image", "targetPath": "/opt/glance/demo/target",
                                                     "drafterPath": "/opt/glance/demo/drafter"}}})
    dep, c = _container(docs, "-engine")
    assert "models" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert "--speculative-draft-model-path /opt/glance/demo/drafter" in " ".join(c["args"])
    assert not find(docs, "PersistentVolumeClaim")


@pytest.mark.parametrize("profile", ["default", "gpu", "all-on"])
def test_gateway_points_at_the_engine_service(rendered, profile):
    docs = rendered[profile]
    _, c = _container(docs, "-gateway")
    (svc,) = find(docs, "Service", "-engine")
    args = c["args"]
    assert args[:1] == ["serve"] and _arg(args, "--backend") == "sglang"
    assert _arg(args, "--upstream") == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    (engine_dep,) = find(docs, "Deployment", "-engine")
    pod_labels = engine_dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_cpu_demo_is_the_embedded_gateway_without_gpu(rendered):
    docs = rendered["cpu-demo"]
    dep, c = _container(docs, "-gateway")
    assert c["command"] == ["glance"]
    assert _arg(c["args"], "--backend") == "embedded" and "--upstream" not in c["args"]
    assert dep["spec"]["replicas"] == 1
    text = repr(objects(docs))
    assert "nvidia.com/gpu" not in text and "sglang.launch_server" not in text


def test_api_key_from_a_secret(chart, rendered):
    docs = rendered["all-on"]
    _, c = _container(docs, "-gateway")
    assert _arg(c["args"], "--api-key-env") == "GLANCE_API_KEY"
    env = {e["name"]: e for e in c["env"]}
    ref = env["GLANCE_API_KEY"]["valueFrom"]["secretKeyRef"]
    (secret,) = find(docs, "Secret")
    assert ref == {"name": secret["metadata"]["name"], "key": "token"}
    assert "token" in secret["data"]
    # A generated key when none is given; an existing Secret is referenced, not created.
    generated = render_docs(chart, {"gateway": {"apiKey": {"enabled": True}}})
    (secret,) = find(generated, "Secret")
    assert len(secret["data"]["api-key"]) > 40
    existing = render_docs(chart, {"gateway": {"apiKey": {"enabled": True, "existingSecret": "my-key"}}})
    assert not find(existing, "Secret")
    _, c = _container(existing, "-gateway")
    assert {e["name"]: e for e in c["env"]}["GLANCE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-key"
    # The helm test pod authenticates with the same key.
    (pod,) = find(existing, "Pod", "-test")
    test_env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert test_env["GLANCE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-key"


def test_gateway_probes_and_autoscaling(rendered):
    docs = rendered["all-on"]
    dep, c = _container(docs, "-gateway")
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "replicas" not in dep["spec"], "an autoscaled Deployment leaves replicas to the HPA"
    hpas = {h["metadata"]["name"]: h for h in find(docs, "HorizontalPodAutoscaler")}
    deployments = {d["metadata"]["name"] for d in find(docs, "Deployment")}
    for hpa in hpas.values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    (engine_hpa,) = [h for n, h in hpas.items() if n.endswith("-engine")]
    (metric,) = engine_hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "sglang_num_queue_reqs"
    (gw_hpa,) = [h for n, h in hpas.items() if n.endswith("-gateway")]
    assert {m["resource"]["name"] for m in gw_hpa["spec"]["metrics"]} == {"cpu", "memory"}


@pytest.mark.parametrize("profile", list(PROFILES))
def test_pod_security(rendered, profile):
    for obj in objects(rendered[profile]):
        pod = obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else (
            obj["spec"] if obj["kind"] == "Pod" else None)
        if pod is None:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "resources" in c
            assert not c["image"].endswith(":latest")


@pytest.mark.parametrize("profile", ["default", "gpu", "all-on"])
def test_only_the_gateway_reaches_the_engine(rendered, profile):
    docs = rendered[profile]
    (np,) = find(docs, "NetworkPolicy", "-engine")
    (gw,) = find(docs, "Deployment", "-gateway")
    (engine,) = find(docs, "Deployment", "-engine")
    assert np["spec"]["podSelector"]["matchLabels"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = np["spec"]["ingress"]
    gateway_labels = gw["spec"]["template"]["metadata"]["labels"]
    selectors = [peer for peer in rule["from"] if "podSelector" in peer]
    assert len(selectors) == 1
    assert selectors[0]["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    assert "namespaceSelector" not in selectors[0]
    # Every other peer is a metrics scraper from values.networkPolicy.metricsFrom.
    values = load_values(PROFILES[profile]) or {}
    assert len(rule["from"]) == 1 + len(values.get("networkPolicy", {}).get("metricsFrom", []))


def test_restricted_egress(rendered):
    docs = rendered["all-on"]
    (gw_np,) = find(docs, "NetworkPolicy", "-gateway")
    assert "Egress" in gw_np["spec"]["policyTypes"]
    to_engine = [r for r in gw_np["spec"]["egress"] if any("podSelector" in p for p in r.get("to", []))]
    assert to_engine and to_engine[0]["ports"][0]["port"] == 31000
    (engine_np,) = find(docs, "NetworkPolicy", "-engine")
    assert [p["port"] for r in engine_np["spec"]["egress"] for p in r["ports"]] == [53, 53]


def test_service_monitor_selects_both_services(rendered):
    docs = rendered["all-on"]
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for svc in find(docs, "Service"):
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert svc["spec"]["ports"][0]["name"] == sm["spec"]["endpoints"][0]["port"]


def test_helm_test_hook_calls_the_gateway(rendered):
    docs = rendered["default"]
    (pod,) = find(docs, "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (svc,) = find(docs, "Service", "-gateway")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["GATEWAY_URL"] == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    script = pod["spec"]["containers"][0]["args"][0]
    compile(script, "helm-test", "exec")  # the embedded script is valid Python
    assert "/v1/chat/completions" in script and "/health" in script


def test_config_change_rolls_the_pods(chart):
    base = render_docs(chart, None)
    changed = render_docs(chart, {"engine": {"speculative": {"treeBudget": 15}}})
    for suffix in ("-engine", "-gateway"):
        (a,) = find(base, "Deployment", suffix)
        (b,) = find(changed, "Deployment", suffix)
        key = "checksum/config"
        assert a["spec"]["template"]["metadata"]["annotations"][key] != \
            b["spec"]["template"]["metadata"]["annotations"][key]


def test_selectors_match_pod_labels(rendered):
    for profile, docs in rendered.items():
        for kind in ("Deployment",):
            for dep in find(docs, kind):
                sel = dep["spec"]["selector"]["matchLabels"]
                assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items(), profile
        for pdb in find(docs, "PodDisruptionBudget"):
            sel = pdb["spec"]["selector"]["matchLabels"]
            assert any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                       for d in find(docs, "Deployment")), profile


def test_notes_render(chart):
    for path in PROFILES.values():
        out = chart.render(values=load_values(path), name="glance", namespace=NAMESPACE)
        notes = out["glance/templates/NOTES.txt"]
        assert "helm test glance" in notes
        values = copy.deepcopy(load_values(path) or {})
        if values.get("engine", {}).get("enabled", True):
            assert "rollout status deployment/" in notes
