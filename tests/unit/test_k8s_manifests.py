"""deploy/k8s: every manifest is a valid Kubernetes object, and the manifests agree with the code.

Schema validation uses kubernetes-validate (requirements-test.txt), whose wheel ships the
Kubernetes JSON schemas, so this runs offline; strict mode also refuses unknown fields (a typo
such as `readinessprobe` is silently ignored by a cluster). Checked against the oldest version
the manifests claim (1.30: `preStop.sleep`) and the newest schema the package has.

Beyond the schema: the probes hit Triton's health endpoints on the named ports, the HPA's
custom metrics are the ones the adapter rules define, and those rules read series and label
values that the engine model really exports (`inflight.serving.metrics`).
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from inflight.api.stats import IterationStats
from inflight.serving.metrics import GAUGE_FAMILIES, gauge_values
from tests.conftest import REPO_ROOT

# CI has it installed (make setup); a bare `make test-unit PY=python3` may not, and skips.
if os.environ.get("CI"):
    import kubernetes_validate
    import yaml
else:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    yaml = pytest.importorskip("yaml")

K8S_DIR = REPO_ROOT / "deploy" / "k8s"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


DOCS = _documents()


def _one(kind: str) -> dict:
    found = [doc for _, doc in DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_schema(version):
    assert len(DOCS) >= 6
    for name, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is not a valid Kubernetes {version} object: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_probes_and_ports_follow_triton():
    pod = _one("Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
    # The drain (launcher --exit_timeout) ends before the kubelet kills the pod.
    command = container["args"][0]
    exit_timeout = float(re.search(r"--exit_timeout (\d+)", command).group(1))
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > exit_timeout + pre_stop_s


def test_container_command_uses_real_flags():
    from tools import build_repository
    command = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"][0]
    build, launch = command.split("&&")
    build_flags = {t[2:] for t in shlex.split(build) if t.startswith("--")}
    known = set(build_repository.DEFAULTS) | {"model", "out", "force", "tokenizer_dir", "set"}
    assert build_flags <= known, build_flags - known
    launcher = (REPO_ROOT / "tools" / "launch_triton_server.py").read_text()
    for flag in (t for t in shlex.split(launch) if t.startswith("--")):
        assert f'"{flag}"' in launcher, f"launch_triton_server.py has no {flag}"


def test_autoscaling_reads_metrics_the_server_exports():
    rules = yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])["rules"]
    defined = {rule["name"]["as"]: rule for rule in rules}
    hpa = _one("HorizontalPodAutoscaler")
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert used and used <= set(defined), used - set(defined)
    exported = set(gauge_values(IterationStats()))
    for name in used:
        series = re.match(r"(\w+)\{(\w+)=\"(\w+)\"", defined[name]["seriesQuery"])
        family, label_key, label_value = series.groups()
        assert family in GAUGE_FAMILIES and GAUGE_FAMILIES[family][0] == label_key
        assert (family, label_value) in exported, (family, label_value)
        assert f'{label_key}="{label_value}"' in defined[name]["metricsQuery"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", _one("Deployment")["metadata"]["name"])


def test_docs_name_every_manifest():
    doc = (REPO_ROOT / "docs" / "scale_out.md").read_text()
    for path in K8S_DIR.glob("*.yaml"):
        assert path.name in doc, f"docs/scale_out.md does not mention {path.name}"
