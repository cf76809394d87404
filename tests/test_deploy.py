"""Offline checks of the deployment files: docker-compose.yml against the compose-spec schema,
the Kubernetes manifests against the Kubernetes schemas, and the facts the deploy shape relies
on. No Docker engine or cluster is needed (see deploy/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30"
REPLICAS = ("turnstore-1", "turnstore-2", "turnstore-3")


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _manifests() -> dict[str, dict[str, Any]]:
    """kind -> manifest, for every Kubernetes manifest (one kind per file)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        assert len(docs) == 1, f"{path.name}: expected one manifest"
        assert docs[0]["kind"] not in found, f"{path.name}: a second {docs[0]['kind']}"
        found[docs[0]["kind"]] = docs[0]
    return found


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    tool = Path(sys.executable).parent / "check-jsonschema"  # missing tool: the test fails
    result = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_migration_once_before_three_replicas() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"

    migrate = services["migrate"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])

    turnstores = {name for name, s in services.items() if s.get("image") == migrate["image"]}
    assert turnstores == {"migrate", *REPLICAS}
    for name in REPLICAS:
        replica = services[name]
        assert replica["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
        env = replica["environment"]
        assert env["DATABASE_URL"].startswith("postgresql+asyncpg://")
        assert env["DATABASE_URL"] == migrate["environment"]["DATABASE_URL"]
        assert env["AUTH_MODE"] == "none"
        assert env["LLM_PROVIDER"] == "${LLM_PROVIDER:-fake}"
        assert "/readyz" in " ".join(replica["healthcheck"]["test"])
        assert replica.get("command") is None  # the image's default: serve on 0.0.0.0:8000


def test_compose_load_balancer_passes_streams_through_to_every_replica() -> None:
    lb = _compose()["services"]["lb"]
    # AUTH_MODE=none behind it: published on loopback only, never on every interface.
    assert [str(port) for port in lb["ports"]] == ["127.0.0.1:8080:80"]
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in lb["volumes"]

    conf = (DEPLOY / "nginx.conf").read_text()
    upstream = re.search(r"upstream turnstore \{(.*?)\}", conf, re.S)
    assert upstream is not None
    servers = set(re.findall(r"^\s*server ([\w-]+):8000\b", upstream.group(1), re.M))
    assert servers == set(REPLICAS)
    assert re.search(r"^\s*keepalive \d+;", upstream.group(1), re.M)
    for directive in (
        "proxy_pass http://turnstore;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_buffering off;",
        "proxy_set_header X-Correlation-Id $correlation_id;",
    ):
        assert directive in conf
    read_timeout = re.search(r"proxy_read_timeout (\d+)s;", conf)
    assert read_timeout is not None and int(read_timeout.group(1)) >= 300


def test_kubernetes_manifests_are_valid() -> None:
    import kubernetes_validate  # missing tool: the test fails

    manifests = _manifests()
    assert set(manifests) == {
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Job",
        "PodDisruptionBudget",
        "Secret",
        "Service",
    }
    errors = []
    for kind, manifest in manifests.items():
        try:  # strict: unknown fields are errors, as with `kubernetes-validate --strict`
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{kind}: {exc.message} at {'.'.join(map(str, exc.path))}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # the CLI only warns
            errors.append(f"{kind}: {exc.message}")
    assert not errors

    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    expected = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == expected - {"secret.example.yaml"}


def test_kubernetes_deployment_shape() -> None:
    manifests = _manifests()
    deployment = manifests["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["lifecycle"]["preStop"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"requests", "limits"} <= set(container["resources"])
    env_from = {next(iter(ref)) for ref in container["envFrom"]}
    assert env_from == {"configMapRef", "secretRef"}
    assert pod["terminationGracePeriodSeconds"] >= 35  # preStop 5 s + uvicorn's 30 s drain

    job = manifests["Job"]
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["db", "upgrade"]
    assert migrate["image"] == container["image"]
    assert job["spec"]["backoffLimit"] >= 1

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        manifests["Service"]["spec"]["selector"],
        manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    assert not manifests["Service"]["spec"]["selector"].items() <= job_labels.items()
    assert manifests["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    hpa = manifests["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 3


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    return pins


def test_lock_pins_every_runtime_dependency_compatibly() -> None:
    pins = _lock()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for raw in project["dependencies"]:
        requirement = Requirement(raw)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in deploy/requirements.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{requirement.name}=={pins[name]} does not satisfy {raw}"
        )


def test_lock_is_closed_under_dependencies() -> None:
    """What a pinned package needs is pinned too (by name, read from the installed metadata),
    so `pip install --no-deps -r requirements.lock` in the image misses nothing."""
    pins = _lock()
    for name in pins:
        for raw in metadata.requires(name) or []:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                assert canonicalize_name(requirement.name) in pins, (
                    f"{name} needs {requirement.name}, which deploy/requirements.lock lacks"
                )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for raw in project["dependencies"]:
        requirement = Requirement(raw)
        for extra in requirement.extras:
            for needed in map(Requirement, metadata.requires(requirement.name) or []):
                if needed.marker is not None and needed.marker.evaluate({"extra": extra}):
                    assert canonicalize_name(needed.name) in pins, (
                        f"{requirement.name}[{extra}] needs {needed.name}, not pinned"
                    )
