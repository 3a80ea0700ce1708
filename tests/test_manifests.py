"""deploy/k8s: the Kubernetes manifests, validated offline.

Every core resource is checked by ``kubernetes-validate`` against the Kubernetes API's own
OpenAPI schemas (strict: unknown fields refused); the ServiceMonitor (a CRD) against the
fields of prometheus-operator's CRD that it uses. Then the wiring a schema cannot see:
Services select pods that exist and name ports the containers have, volumes point at claims
and the ConfigMap that exist, images are Dockerfile stages, the controller's DNS spec names
the headless Service, and flywheel.toml's ports are the containers' ports. Issue 19 item 4:
every role has probes on a port it serves and runs as the image's user with an fsGroup; serving
is a StatefulSet whose journal is on a per-pod claim, under a PodDisruptionBudget that selects
its pods; its product Service carries the product port only and the NetworkPolicy admits the
admin port from the controller and Prometheus only; the user salt is mounted from a Secret;
the learner's state is on the shared claim, not on an emptyDir."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.34.0"
KUST = yaml.safe_load((K8S / "kustomization.yaml").read_text())
CONFIG = tomllib.loads((K8S / "flywheel.toml").read_text())


def _serve_port() -> int:
    """The product port the example serves on: its `[serve] port`, else ServeConfig's default."""
    from serving.config import ServeConfig

    return CONFIG["serve"].get("port", ServeConfig.model_fields["port"].default)


def docs() -> list[dict]:
    """Every resource ``kubectl apply -k deploy/k8s`` creates (the generated ConfigMap too),
    with the kustomization's namespace."""
    out = []
    for f in KUST["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / f).read_text()) if d]
    for g in KUST["configMapGenerator"]:
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]},
                    "data": {Path(f).name: (K8S / f).read_text() for f in g["files"]}})
    for d in out:
        if d["kind"] != "Namespace":
            d["metadata"]["namespace"] = KUST["namespace"]
    return out


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def workloads() -> list[dict]:
    return [d for d in docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]


# the fields of monitoring.coreos.com/v1 ServiceMonitor used here (prometheus-operator CRD)
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "properties": {
                         "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
                     "namespaceSelector": {"type": "object", "properties": {
                         "matchNames": {"type": "array", "items": {"type": "string"}},
                         "any": {"type": "boolean"}}, "additionalProperties": False},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": {"type": "string", "pattern": r"^(0|(\d+(ms|s|m|h))+)$"},
                                        "scheme": {"enum": ["http", "https"]}}}}}}}}


def test_every_file_of_the_kustomization_exists_and_parses():
    names = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(KUST["resources"]) == names  # nothing left out of the kustomization
    kinds = {d["kind"] for d in docs()}
    assert {"Deployment", "StatefulSet", "Service", "ServiceMonitor", "ConfigMap", "Job",
            "PersistentVolumeClaim", "Namespace"} <= kinds


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_resource_is_valid(doc):
    if doc["kind"] == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validator_refuses_a_broken_resource():
    """The check has teeth: a misspelt field and a wrong type are refused."""
    d = by_kind("StatefulSet")["flywheel-serving"]
    bad = yaml.safe_load(yaml.safe_dump(d))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(d))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _pod(w: dict) -> dict:
    return w["spec"]["template"]


def test_services_select_pods_and_name_their_ports():
    pods = [_pod(w) for w in workloads()]
    for name, svc in by_kind("Service").items():
        sel = svc["spec"]["selector"]
        hits = [p for p in pods if sel.items() <= p["metadata"]["labels"].items()]
        assert hits, f"Service {name} selects no pod"
        ports = {p["name"] for pod in hits for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for sp in svc["spec"]["ports"]:
            assert sp["targetPort"] in ports, f"Service {name}: no container port {sp['targetPort']}"


def test_volumes_claims_config_and_images_exist():
    claims = set(by_kind("PersistentVolumeClaim"))
    maps = set(by_kind("ConfigMap"))
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    kust_images = {i["name"] for i in KUST["images"]}
    for w in workloads():
        spec = _pod(w)["spec"]
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for v in vols.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, v
            if "configMap" in v:
                assert v["configMap"]["name"] in maps, v
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols or m["name"] in templates, (w["metadata"]["name"], m)
            image = c["image"]
            assert image in kust_images and image.removeprefix("flywheel/") in stages, image
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("FLYWHEEL_CONFIG") == "/etc/flywheel/flywheel.toml"
            assert any(m["mountPath"] == "/etc/flywheel/flywheel.toml" for m in c["volumeMounts"])


def test_serving_has_a_gpu_and_the_engine_options():
    c = _pod(by_kind("StatefulSet")["flywheel-serving"])["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["image"] == "flywheel/serve-vllm"
    serve = CONFIG["serve"]
    assert serve["engine"] == "vllm" and {"dtype", "max_model_len", "gpu_memory_utilization"} <= set(serve)
    assert c["ports"][0]["containerPort"] == _serve_port()
    learner = _pod(by_kind("Deployment")["flywheel-learner"])["spec"]["containers"][0]
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_controller_finds_serving_pods_by_the_headless_service():
    """The name is namespace-relative (a second deployment in another namespace needs no edit)
    and the port is the pods' admin port, where /admin answers."""
    (spec,) = CONFIG["controller"]["serving"]
    m = re.fullmatch(r"dns\+http://([a-z0-9-]+):(\d+)", spec)
    assert m, spec
    svc = by_kind("Service")[m.group(1)]
    assert svc["spec"]["clusterIP"] == "None"
    assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]} and int(m.group(2)) == CONFIG["serve"]["admin_port"]
    assert CONFIG["serving_url"] == f"http://{m.group(1)}:{m.group(2)}"


def test_metrics_ports_match_the_config_and_are_scraped():
    ports = {"flywheel-ingest": CONFIG["ingest"]["worker_port"], "flywheel-learner": CONFIG["learn"]["metrics_port"],
             "flywheel-controller": CONFIG["controller"]["metrics_port"],
             "flywheel-serving-pods": CONFIG["serve"]["admin_port"]}
    services = by_kind("Service")
    (sm,) = by_kind("ServiceMonitor").values()
    wanted = sm["spec"]["selector"]["matchLabels"]
    scraped_ports = {e["port"] for e in sm["spec"]["endpoints"]}
    for name, port in ports.items():
        svc = services[name]
        assert wanted.items() <= svc["metadata"]["labels"].items(), f"{name} is not scraped"
        (p,) = [p for p in svc["spec"]["ports"] if p["name"] in scraped_ports]
        assert p["port"] == port, (name, p, port)
    # the ClusterIP Service of serving is not scraped (each pod would count twice)
    assert not wanted.items() <= services["flywheel-serving"]["metadata"]["labels"].items()


ROLES = {"flywheel-serving": "StatefulSet", "flywheel-ingest": "StatefulSet", "flywheel-learner": "Deployment",
         "flywheel-controller": "Deployment"}


def _role(name: str) -> dict:
    return by_kind(ROLES[name])[name]


def _mount_volume(w: dict, path: str) -> dict:
    """The volume (or claim template) mounted at ``path``, or at the deepest mount above it."""
    spec = _pod(w)["spec"]
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    vols.update({t["metadata"]["name"]: {"name": t["metadata"]["name"], "claimTemplate": t}
                 for t in w["spec"].get("volumeClaimTemplates", [])})
    mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, (w["metadata"]["name"], path)
    return vols[max(mounts, key=lambda m: len(m["mountPath"]))["name"]]


def test_every_role_has_probes_on_a_port_it_serves():
    for name in ROLES:
        (c,) = _pod(_role(name))["spec"]["containers"]
        ports = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["port"] in ports and get["path"] in ("/health", "/metrics"), (name, probe, get)
    serving = _pod(_role("flywheel-serving"))["spec"]["containers"][0]
    assert serving["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # what the Service routes


def test_every_pod_runs_as_the_images_user_and_can_write_its_volumes():
    uid = re.search(r"useradd --uid (\d+) --gid (\d+)", (ROOT / "Dockerfile").read_text())
    for w in workloads():
        sc = _pod(w)["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == int(uid.group(1)), w["metadata"]["name"]
        assert sc["fsGroup"] == sc["runAsGroup"] == int(uid.group(2)), w["metadata"]["name"]
        for c in _pod(w)["spec"]["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_serving_journal_is_on_a_per_pod_volume_and_disruptions_are_bounded():
    sts = _role("flywheel-serving")
    assert sts["spec"]["serviceName"] == "flywheel-serving-pods" and sts["spec"]["replicas"] >= 2
    home = CONFIG["home"]  # $FLYWHEEL_HOME: the journal is $FLYWHEEL_HOME/serving/<pod>.journal
    vol = _mount_volume(sts, home + "/serving/flywheel-serving-0.journal")
    assert vol["claimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    (pdb,) = by_kind("PodDisruptionBudget").values()
    assert pdb["spec"]["maxUnavailable"] == 1
    labels = _pod(sts)["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    others = [_pod(w) for w in workloads() if w["metadata"]["name"] != "flywheel-serving"]
    assert not any(pdb["spec"]["selector"]["matchLabels"].items() <= p["metadata"]["labels"].items() for p in others)


def test_the_user_salt_comes_from_a_mounted_secret():
    sts = _role("flywheel-serving")
    (c,) = _pod(sts)["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "FLYWHEEL_USER_SALT" not in env and CONFIG["serve"]["fleet"] is True
    vol = _mount_volume(sts, env["FLYWHEEL_USER_SALT_FILE"]["value"])
    item = vol["secret"]["items"][0]
    assert env["FLYWHEEL_USER_SALT_FILE"]["value"].endswith("/" + item["path"]) and item["key"] == "user-salt"
    assert vol["secret"]["secretName"] == "flywheel-user-salt"


def test_learner_state_is_on_shared_storage():
    learner = _role("flywheel-learner")
    state = CONFIG["learn"]["state"]
    vol = _mount_volume(learner, state + "/learner_state.json")
    assert vol["persistentVolumeClaim"]["claimName"] == "flywheel-shared"
    assert by_kind("PersistentVolumeClaim")["flywheel-shared"]["spec"]["accessModes"] == ["ReadWriteMany"]
    # and the home it would otherwise default to is an emptyDir: the setting is what saves it
    assert "emptyDir" in _mount_volume(learner, CONFIG["home"] + "/learner")


def test_admin_and_metrics_are_off_the_product_service():
    """The product Service forwards the product port only; the admin port is on the headless
    Service, and the NetworkPolicy admits it from the controller and Prometheus only."""
    sts = _role("flywheel-serving")
    (c,) = _pod(sts)["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": _serve_port(), "admin": CONFIG["serve"]["admin_port"]}
    svc = by_kind("Service")
    assert [p["targetPort"] for p in svc["flywheel-serving"]["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in svc["flywheel-serving-pods"]["spec"]["ports"]] == ["admin"]
    pol = by_kind("NetworkPolicy")["flywheel-serving"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= _pod(sts)["metadata"]["labels"].items()
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    admitted: dict[str, list] = {}
    for rule in pol["spec"]["ingress"]:
        for p in rule["ports"]:
            admitted.setdefault(p["port"], []).append(rule.get("from"))
    assert admitted["http"] == [None]  # anyone may call the product API
    (sources,) = admitted["admin"]
    ctl_labels = _pod(_role("flywheel-controller"))["metadata"]["labels"]
    assert any("podSelector" in s and s["podSelector"]["matchLabels"].items() <= ctl_labels.items() for s in sources)
    assert any("namespaceSelector" in s for s in sources) and len(sources) == 2  # + Prometheus' namespace
    internal = by_kind("NetworkPolicy")["flywheel-internal"]
    comps = set(internal["spec"]["podSelector"]["matchExpressions"][0]["values"])
    assert comps == {"ingest", "learner", "controller"}
    assert [p["port"] for r in internal["spec"]["ingress"] for p in r["ports"]] == ["metrics"]
