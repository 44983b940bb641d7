"""The deployment files parse with the tools that run here (no Docker engine on these machines)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str) -> str:
    binary = shutil.which(cmd[0])
    assert binary, f"{cmd[0]} is missing (.ci/run installs it from Debian)"
    done = subprocess.run([binary, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_compose_config_lists_the_stack() -> None:
    services = set(
        run("docker-compose", "-f", "docker-compose.yml", "config", "--services").split()
    )
    assert {
        "streambatch",
        "streambatch-cpu",
        "otel-collector",
        "jaeger",
        "prometheus",
        "grafana",
    } <= services
    balancer = run(
        "docker-compose", "-f", "docker-compose.yml", "--profile", "balancer", "config",
        "--services",
    ).split()  # fmt: skip
    assert "balancer" in balancer
    rendered = run("docker-compose", "-f", "docker-compose.yml", "config")
    assert "driver: nvidia" in rendered  # the GPU reservation on the default service
    assert "grpc_health" in rendered  # the server's health check speaks the gRPC protocol


def test_prometheus_config_passes_promtool() -> None:
    assert "SUCCESS" in run("promtool", "check", "config", "deploy/prometheus.yml")


def test_images_build_the_extension_as_non_root() -> None:
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (ROOT / "deploy" / "docker" / name).read_text()
        assert text.count("FROM ") == 2, f"{name} should be multi-stage"
        assert "USER streambatch" in text
        assert 'VOLUME ["/models"]' in text
        assert "COPY csrc" in text and "pip install" in text


def test_envoy_and_kubernetes_files_parse() -> None:
    import yaml

    envoy = yaml.safe_load((ROOT / "deploy/envoy/envoy.yaml").read_text())
    cluster = envoy["static_resources"]["clusters"][0]
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == (
        "streambatch.v1.Generation"
    )
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/streambatch.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["grpc"]["port"] == 50051


def test_kubernetes_manifests_pass_the_kubernetes_schema(tmp_path: Path) -> None:
    """kubernetes-validate holds the published schemas (offline), strict: an unknown field
    fails, as the API server would reject it."""
    manifest = ROOT / "deploy/k8s/streambatch.yaml"
    out = run(str(Path(sys.executable).parent / "kubernetes-validate"), "--strict",
              "-k", "1.34.0", str(manifest))  # fmt: skip
    assert "passed for resource deployment/streambatch" in out
    assert "passed for resource service/streambatch" in out
    broken = tmp_path / "broken.yaml"
    broken.write_text(manifest.read_text().replace("replicas:", "replicaCount:", 1))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", "1.34.0",
         str(broken)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout


def test_haproxy_config_passes_haproxy_check(tmp_path: Path) -> None:
    config = (ROOT / "deploy/haproxy/haproxy.cfg").read_text()
    config = (
        config.replace("@LISTEN@", "127.0.0.1:8080").replace("@STATS@", "127.0.0.1:8404")
        .replace("@CHECK@", str(ROOT / "deploy/haproxy/grpc-health-check.sh"))
        .replace("@PATH@", "/usr/bin:/bin")
        .replace("@SERVERS@", "  server r0 127.0.0.1:50051\n  server r1 127.0.0.1:50052")
    )  # fmt: skip
    (tmp_path / "haproxy.cfg").write_text(config)
    assert "Configuration file is valid" in run(
        "haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")
    )
