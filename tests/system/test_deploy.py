"""Offline checks of the deployment files: docker-compose.yml against the compose-spec schema,
the Kubernetes manifests against the Kubernetes schemas, and the facts the deploy shape relies
on. No Docker engine or cluster is needed (see deploy/README.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RECOMMENDED = DEPLOY / "overlays" / "recommended"
CNPG_CLUSTER = K8S / "cnpg" / "cluster.yaml"
SERVICE_MONITOR = K8S / "monitoring" / "servicemonitor.yaml"
ADAPTER_VALUES = K8S / "monitoring" / "prometheus-adapter-values.yaml"
KUBERNETES_VERSION = "1.30"
BUILT_IN = {
    "ConfigMap",
    "CronJob",
    "Deployment",
    "HorizontalPodAutoscaler",
    "Job",
    "PodDisruptionBudget",
    "Service",
}
EXAMPLES = {"secret.example.yaml": "Secret", "ingress.example.yaml": "Ingress"}
REPLICAS = ("turnstore-1", "turnstore-2", "turnstore-3")


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _load(path: Path) -> dict[str, Any]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert len(docs) == 1, f"{path.name}: expected one manifest"
    manifest: dict[str, Any] = docs[0]
    return manifest


def _manifests() -> dict[str, dict[str, Any]]:
    """kind -> manifest, for every Kubernetes manifest in deploy/k8s (one kind per file; the
    optional components live in subdirectories)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        manifest = _load(path)
        assert manifest["kind"] not in found, f"{path.name}: a second {manifest['kind']}"
        found[manifest["kind"]] = manifest
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


def _validate_kubernetes(manifests: Iterable[dict[str, Any]]) -> list[str]:
    """Errors of built-in manifests against the Kubernetes schemas, strict: an unknown field or
    kind is an error, as with `kubernetes-validate --strict`."""
    import kubernetes_validate  # missing tool: the test fails

    errors = []
    for manifest in manifests:
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {exc.message} at {'.'.join(map(str, exc.path))}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # the CLI only warns
            errors.append(f"{name}: {exc.message}")
    return errors


def _kustomize(path: Path) -> dict[str, dict[str, Any]]:
    """kind -> object, as `kubectl kustomize` renders the kustomization at ``path`` (offline:
    kustomize is built into kubectl and contacts no cluster)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed for `kubectl kustomize` (no cluster is contacted)"
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered: dict[str, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(result.stdout):
        assert doc["kind"] not in rendered, f"{path}: a second {doc['kind']}"
        rendered[doc["kind"]] = doc
    return rendered


def _template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment, Job or CronJob."""
    spec = workload["spec"]
    template: dict[str, Any] = (
        spec["jobTemplate"]["spec"]["template"] if "jobTemplate" in spec else spec["template"]
    )
    return template


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = _template(workload)["spec"]
    return pod


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = _pod(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _metric_kinds() -> dict[str, str]:
    """Prometheus metric name -> Counter, Gauge or Histogram, as service/platform/metrics.py declares."""
    source = (ROOT / "service" / "platform" / "metrics.py").read_text()
    found = re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(turnstore_\w+)\"", source)
    return {name: kind for kind, name in found}


def _quantity(value: str) -> int:
    """A size in bytes: Kubernetes ("512Mi", "20Gi") or nginx ("2m")."""
    match = re.fullmatch(r"(\d+)(|[kmg]|[KMG]i)", value)
    assert match is not None, f"not a size: {value}"
    scale = {"": 0, "k": 1, "Ki": 1, "m": 2, "Mi": 2, "g": 3, "Gi": 3}[match.group(2)]
    return int(match.group(1)) * 1024**scale


def test_kubernetes_manifests_are_valid() -> None:
    manifests = _manifests()
    assert set(manifests) == BUILT_IN | set(EXAMPLES.values())
    assert not _validate_kubernetes(manifests.values())

    # Listed: every manifest of deploy/k8s but the examples, which need the operator's values.
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    expected = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == expected - set(EXAMPLES)
    assert set(EXAMPLES) <= expected


def test_kustomizations_render_base_and_recommended_stack() -> None:
    # The base applies to any cluster: built-in kinds only, valid once rendered.
    base = _kustomize(K8S)
    assert set(base) == BUILT_IN
    assert not _validate_kubernetes(base.values())

    # The recommended overlay adds the two components; their patches must leave the built-in
    # objects valid (a typo in a patch would add an unknown field here).
    stack = _kustomize(RECOMMENDED)
    assert set(stack) == BUILT_IN | {"Cluster", "ServiceMonitor"}
    assert not _validate_kubernetes(stack[kind] for kind in BUILT_IN)
    assert stack["Cluster"] == _load(CNPG_CLUSTER)
    assert stack["ServiceMonitor"] == _load(SERVICE_MONITOR)
    assert stack["Cluster"]["apiVersion"] == "postgresql.cnpg.io/v1"
    assert stack["ServiceMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"


def test_image_set_in_the_base_reaches_every_turnstore_container(tmp_path: Path) -> None:
    """`kustomize edit set image` in deploy/k8s (deploy/README.md) must retag the replicas, the
    migration, its wait for the database and purge, in the base and in the overlay."""
    copy = tmp_path / "deploy"
    shutil.copytree(K8S, copy / "k8s")
    shutil.copytree(RECOMMENDED.parent, copy / "overlays")
    kustomization = yaml.safe_load((copy / "k8s" / "kustomization.yaml").read_text())
    kustomization["images"] = [
        {"name": "turnstore", "newName": "registry.example/turnstore", "newTag": "9.9.9"}
    ]
    (copy / "k8s" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    for rendered in (_kustomize(copy / "k8s"), _kustomize(copy / "overlays" / "recommended")):
        images = {
            f"{kind}/{container['name']}": container["image"]
            for kind in ("Deployment", "Job", "CronJob")
            for container in _containers(rendered[kind])
        }
        assert set(images) == {
            "Deployment/turnstore",
            "Job/wait-for-database",
            "Job/migrate",
            "CronJob/purge",
        }
        assert set(images.values()) == {"registry.example/turnstore:9.9.9"}


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

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        manifests["Service"]["spec"]["selector"],
        manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    # The one-shot pods are neither served nor counted by the PDB.
    for one_shot in (manifests["Job"], manifests["CronJob"]):
        pod_labels = _template(one_shot)["metadata"]["labels"]
        assert not manifests["Service"]["spec"]["selector"].items() <= pod_labels.items()
        assert not manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= (
            pod_labels.items()
        )
    assert manifests["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    hpa = manifests["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 3


def test_migration_job_waits_for_the_database_then_upgrades_once() -> None:
    manifests = _manifests()
    (server,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    job = manifests["Job"]
    pod = _pod(job)
    (migrate,) = pod["containers"]
    assert migrate["command"] == ["/bin/sh", "-c"]
    assert _migration(job) == ["turnstore db upgrade"]  # TURNSTORE_DISTRIBUTE is "0"
    assert migrate["image"] == server["image"]
    assert job["spec"]["backoffLimit"] >= 1
    assert pod["restartPolicy"] == "Never"
    # Finished Jobs go away by themselves, after time enough to read a failure's logs.
    assert 600 <= job["spec"]["ttlSecondsAfterFinished"] <= 86400

    # The wait: a bounded retry loop of `turnstore db current`, with the migration's own
    # image and credentials, ending before the Job's deadline leaves no time to migrate.
    (wait,) = pod["initContainers"]
    assert wait["image"] == migrate["image"]
    assert wait["envFrom"] == migrate["envFrom"]
    assert wait["command"] == ["/bin/sh", "-c"]
    (script,) = wait["args"]
    assert re.search(r"until out=\$\(timeout \d+ turnstore db current 2>&1\); do", script)
    assert "exit 1" in script
    deadline = re.search(r"deadline=\$\(\( \$\(date \+%s\) \+ (\d+) \)\)", script)
    assert deadline is not None
    assert int(deadline.group(1)) + 120 <= job["spec"]["activeDeadlineSeconds"]
    for step in (wait, migrate):
        assert step["securityContext"] == server["securityContext"]
        assert {"requests", "limits"} <= set(step["resources"])


def _migration(job: dict[str, Any]) -> list[str]:
    """The turnstore commands the migration container's script runs, in order."""
    code, commands, said = _run_migration(job)
    assert code == 0, said
    return commands


def _run_migration(job: dict[str, Any], fail: str = "") -> tuple[int, list[str], str]:
    """The migration container's script run with its own environment against a stand-in
    ``turnstore`` that records each command (and exits 1 for the command ``fail``): its exit
    status, the commands in order, its standard error."""
    import tempfile

    (migrate,) = _pod(job)["containers"]
    (script,) = migrate["args"]
    env = {e["name"]: e["value"] for e in migrate.get("env", []) if "value" in e}
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        (where / "turnstore").write_text(
            '#!/bin/sh\necho "turnstore $*" >> "$RAN"\n[ "turnstore $*" != "$FAIL" ]\n'
        )
        (where / "turnstore").chmod(0o755)
        ran = where / "ran"
        ran.write_text("")
        done = subprocess.run(
            [*migrate["command"], script],
            env={**env, "PATH": f"{where}:/usr/bin:/bin", "RAN": str(ran), "FAIL": fail},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return done.returncode, ran.read_text().splitlines(), done.stderr


def _with_distribute(job: dict[str, Any], value: str) -> dict[str, Any]:
    import copy

    job = copy.deepcopy(job)
    (migrate,) = _pod(job)["containers"]
    migrate["env"] = [e for e in migrate["env"] if e["name"] != "TURNSTORE_DISTRIBUTE"]
    migrate["env"].append({"name": "TURNSTORE_DISTRIBUTE", "value": value})
    return job


def test_migration_job_distributes_on_citus_when_configured_to() -> None:
    job = _manifests()["Job"]
    on_citus = _with_distribute(job, "1")
    upgrade, distribute = "turnstore db upgrade", "turnstore db distribute"
    status = "turnstore db status"
    assert _migration(on_citus) == [upgrade, distribute, status]
    # The first command that fails fails the Job, and nothing runs after it.
    assert _run_migration(on_citus, upgrade)[:2] == (1, [upgrade])
    assert _run_migration(on_citus, distribute)[:2] == (1, [upgrade, distribute])
    assert _run_migration(on_citus, status)[:2] == (1, [upgrade, distribute, status])
    # A value it does not know fails before the database is touched.
    code, ran, said = _run_migration(_with_distribute(job, "true"))
    assert (code, ran) == (2, []) and "TURNSTORE_DISTRIBUTE must be 0 or 1" in said


def test_the_readme_overlay_turns_distribute_on(tmp_path: Path) -> None:
    """deploy/README.md's patch ("Citus: the migration Job"), in an overlay of the base and of
    the recommended stack: the Job then distributes, and stays valid."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("### Citus: the migration Job", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    copy = tmp_path / "deploy"
    shutil.copytree(K8S, copy / "k8s")
    shutil.copytree(RECOMMENDED.parent, copy / "overlays")
    for base in ("../k8s", "../overlays/recommended"):
        mine = copy / "mine"
        shutil.rmtree(mine, ignore_errors=True)
        mine.mkdir()
        (mine / "kustomization.yaml").write_text(
            yaml.safe_dump({"resources": [base], **yaml.safe_load(snippet)})
        )
        rendered = _kustomize(mine)
        assert not _validate_kubernetes([rendered["Job"]])
        assert _migration(rendered["Job"])[1:] == ["turnstore db distribute", "turnstore db status"]


def test_purge_cronjob_runs_like_a_replica_one_run_at_a_time() -> None:
    manifests = _manifests()
    deployment, cronjob = manifests["Deployment"], manifests["CronJob"]
    (server,) = _containers(deployment)
    (purge,) = _containers(cronjob)
    assert purge["args"] == ["purge"]
    # The same image, settings and secrets as the replicas: RETENTION_DAYS and
    # IDEMPOTENCY_TTL_S decide what has expired.
    assert purge["image"] == server["image"]
    assert purge["envFrom"] == server["envFrom"]
    assert purge["securityContext"] == server["securityContext"]
    assert _pod(cronjob)["securityContext"] == _pod(deployment)["securityContext"]
    assert {"requests", "limits"} <= set(purge["resources"])
    assert _pod(cronjob)["restartPolicy"] == "Never"

    spec = cronjob["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert 1 <= spec["successfulJobsHistoryLimit"] <= 3
    assert 1 <= spec["failedJobsHistoryLimit"] <= 5
    assert spec["startingDeadlineSeconds"] > 0
    minute, *rest = spec["schedule"].split()
    assert minute.isdigit() and rest == ["*", "*", "*", "*"], "hourly"
    # A run ends before the next one is due (Forbid would skip it otherwise).
    assert spec["jobTemplate"]["spec"]["activeDeadlineSeconds"] < 3600


def test_autoscaler_scales_on_in_flight_work() -> None:
    manifests = _manifests()
    hpa = manifests["HorizontalPodAutoscaler"]["spec"]
    pods_metrics = {m["pods"]["metric"]["name"]: m["pods"] for m in hpa["metrics"] if "pods" in m}
    assert "turnstore_open_streams" in pods_metrics
    metric_kinds = _metric_kinds()
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    for name, metric in pods_metrics.items():
        # A gauge the service exports today: a metric the adapter cannot serve stops every
        # scale-down.
        assert metric_kinds.get(name) == "Gauge", (
            f"{name} is not a gauge of service/platform/metrics.py"
        )
        assert metric["target"]["type"] == "AverageValue"
        assert int(metric["target"]["averageValue"]) > 0
        # ... and one the documented prometheus-adapter rule serves per pod, under its name.
        (rule,) = [r for r in adapter if re.search(_series_pattern(r), name)]
        go_template = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # ${1} -> \g<1>
        assert re.sub(rule["name"]["matches"], go_template, name) == name
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    # CPU stays, as a backstop only.
    resources = [m["resource"] for m in hpa["metrics"] if m["type"] == "Resource"]
    assert [r["name"] for r in resources] == ["cpu"]
    assert hpa["metrics"][0]["type"] == "Pods"

    # Scale-down ends the streams of the pods removed: slowly, one pod at a time.
    down = hpa["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["selectPolicy"] == "Min"
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert hpa["minReplicas"] > manifests["PodDisruptionBudget"]["spec"]["minAvailable"]


def _series_pattern(rule: dict[str, Any]) -> str:
    match = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
    assert match is not None
    return match.group(1)


def test_database_connections_fit_the_cluster() -> None:
    """Every replica the HPA may start holds at most DB_POOL_SIZE connections (no overflow);
    purge and the migration one each; the rest of max_connections is left to the operator,
    replication and administrators."""
    manifests = _manifests()
    pool = int(manifests["ConfigMap"]["data"]["DB_POOL_SIZE"])
    budget = manifests["HorizontalPodAutoscaler"]["spec"]["maxReplicas"] * pool + 2
    parameters = _load(CNPG_CLUSTER)["spec"]["postgresql"]["parameters"]
    assert budget + 20 <= int(parameters["max_connections"])


def test_configmap_passes_turnstore_settings_validation() -> None:
    from service.platform.settings import Settings

    data = _manifests()["ConfigMap"]["data"]
    settings = Settings.from_env(data | {"OPENAI_API_KEY": "sk-placeholder"})
    assert settings.auth_mode == "api_key"  # replicas listen on 0.0.0.0 in the pod
    assert settings.db_pool_size == int(data["DB_POOL_SIZE"])


def test_servicemonitor_scrapes_metrics_of_every_replica() -> None:
    manifests = _manifests()
    service, deployment = manifests["Service"], manifests["Deployment"]
    monitor = _load(SERVICE_MONITOR)
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert "namespaceSelector" not in monitor["spec"]  # its own namespace: turnstore's
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    # The named Service port that leads to the container port turnstore listens on.
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in server["ports"]}
    interval = re.fullmatch(r"(\d+)s", endpoint["interval"])
    assert interval is not None and int(interval.group(1)) <= 30  # fresh enough for the HPA


def test_ingress_example_streams_sse_and_exposes_only_the_apis() -> None:
    manifests = _manifests()
    ingress = manifests["Ingress"]
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(notes[f"nginx.ingress.kubernetes.io/{timeout}"]) >= 3600
    # turnstore answers an over-size body itself (MAX_BODY_BYTES, 1 MiB by default).
    assert _quantity(notes["nginx.ingress.kubernetes.io/proxy-body-size"]) > 1024 * 1024

    (rule,) = ingress["spec"]["rules"]
    (tls,) = ingress["spec"]["tls"]
    assert tls["hosts"] == [rule["host"]]
    paths = {p["path"]: p for p in rule["http"]["paths"]}
    assert set(paths) == {"/api/v1", "/v1"}  # not /metrics, /readyz, /healthz, /schema
    service_ports = {p["name"] for p in manifests["Service"]["spec"]["ports"]}
    for path in paths.values():
        assert path["pathType"] == "Prefix"
        backend = path["backend"]["service"]
        assert backend["name"] == manifests["Service"]["metadata"]["name"]
        assert backend["port"]["name"] in service_ports


def test_cloudnativepg_cluster_commits_on_a_quorum() -> None:
    cluster = _load(CNPG_CLUSTER)["spec"]
    assert cluster["instances"] == 3
    sync = cluster["postgresql"]["synchronous"]
    assert sync["method"] == "any"  # quorum: ANY 1 (standby, standby)
    assert 0 < sync["number"] < cluster["instances"]  # the operator's webhook rule
    assert sync["dataDurability"] == "required"
    assert sync["failoverQuorum"] is True
    # The deprecated knobs conflict with the synchronous stanza.
    assert not {"minSyncReplicas", "maxSyncReplicas"} & set(cluster)
    assert cluster["affinity"]["podAntiAffinityType"] == "required"
    assert _quantity(cluster["storage"]["size"]) > 0
    assert _quantity(cluster["walStorage"]["size"]) > 0
    resources = cluster["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS
    initdb = cluster["bootstrap"]["initdb"]
    assert initdb["database"] and initdb["owner"]


def test_cloudnativepg_app_secret_gives_turnstore_its_database_url() -> None:
    from service.platform.db import async_url
    from service.platform.settings import Settings

    stack = _kustomize(RECOMMENDED)
    name = stack["Cluster"]["metadata"]["name"]
    initdb = stack["Cluster"]["spec"]["bootstrap"]["initdb"]
    for kind in ("Deployment", "Job", "CronJob"):
        pod = _pod(stack[kind])
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in _containers(stack[kind]):
            env = {e["name"]: e for e in container["env"]}
            where = f"{kind}/{container['name']}"
            # The operator's Secret <cluster>-app, key uri: the read-write service.
            assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
                "name": f"{name}-app",
                "key": "uri",
            }, where
            # TLS verified against the cluster's CA, of which only ca.crt is mounted.
            assert env["PGSSLMODE"]["value"] == "verify-full", where
            ca = Path(env["PGSSLROOTCERT"]["value"])
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(ca.parent)]
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == f"{name}-ca", where
            assert secret["items"] == [{"key": "ca.crt", "path": ca.name}], where

    # The uri CloudNativePG writes (pkg/specs/secrets.go) is a URL turnstore takes as it is.
    uri = f"postgresql://{initdb['owner']}:s3cr3t@{name}-rw.prod:5432/{initdb['database']}"
    assert Settings.from_env({"DATABASE_URL": uri}).database_url == uri
    assert async_url(uri) == (
        f"postgresql+asyncpg://{initdb['owner']}:s3cr3t@{name}-rw.prod:5432/{initdb['database']}"
    )


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
