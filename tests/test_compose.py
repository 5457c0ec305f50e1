"""compose.yaml and the Dockerfile, checked where no Docker engine runs (none on these
machines, and no registry): the file's structure and policies, every command it gives the
image is one the CLI has, every JETLOOP_* variable it sets is a setting, the health checks
ask what the processes serve, and the Dockerfile keeps its rules (dependencies in a cached
layer before the code, not root, `jetloop` the entrypoint)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from jetloop.services.gateway.app import ROUTES
from jetloop.services.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
JETLOOP_SERVICES = ("topology", "worker", "gateway", "projector")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_jetloop_service_runs_the_built_image_and_comes_back() -> None:
    """The jetloop services run the image built from the Dockerfile (no `pip install` at
    start), restart unless stopped (the one-off steps as one-offs), wait for the cluster and
    the topology, mount the user's app where the image looks for it, and the worker scales."""
    services = compose()["services"]
    assert set(services) == {"credentials", "nats1", "nats2", "nats3", *JETLOOP_SERVICES}
    for name in ("credentials", *JETLOOP_SERVICES):
        s = services[name]
        assert s["build"] == "." and s["image"] == "jetloop:local", name
        assert "pip install" not in str(s.get("command", "")), name
    for name in ("worker", "gateway", "projector"):
        s = services[name]
        assert s["restart"] == "unless-stopped", name
        assert s["depends_on"]["topology"] == {"condition": "service_completed_successfully"}
        assert "${JETLOOP_APP_DIR:-./examples}:/srv/app:ro" in s["volumes"], name
        assert s["environment"]["JETLOOP_APP"] == "${JETLOOP_APP:-jetloop.demo.agent:app}"
    for name in ("nats1", "nats2", "nats3"):
        assert services[name]["restart"] == "unless-stopped"
        assert "healthz" in " ".join(services[name]["healthcheck"]["test"])
    assert services["topology"]["restart"] == "on-failure"
    assert services["credentials"]["restart"] == "no"
    assert services["worker"]["deploy"] == {"replicas": 2}
    assert "--scale worker=" in (ROOT / "compose.yaml").read_text()


def test_the_commands_and_settings_are_the_clis() -> None:
    """Every command compose.yaml gives the image is a command of the CLI with its options
    (`--help` of it succeeds), and every JETLOOP_* variable it sets names a setting."""
    services = compose()["services"]
    given = []
    for name in JETLOOP_SERVICES:
        given.append(services[name]["command"])
    (script,) = services["credentials"]["command"]
    first = script.split("&&")[0]
    given.append(shlex.split(first)[1:])  # after `jetloop`
    assert services["credentials"]["entrypoint"] == ["sh", "-c"]
    assert first.strip().startswith("jetloop credentials")
    # As processes of their own: the CLI configures logging for its process, which the
    # tests after this one in the same process must not inherit.
    for args in given:
        ran = subprocess.run(
            [sys.executable, "-m", "jetloop.services.cli", *args, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, (args, ran.stdout, ran.stderr)
        assert ran.stdout.startswith("Usage: "), ran.stdout
    settings = {f"JETLOOP_{n.upper()}" for n in Settings.model_fields}
    named = {k for s in services.values() for k in s.get("environment", {})}
    assert "JETLOOP_NATS_URL" in named and named <= settings, named - settings


def test_the_health_checks_ask_what_the_processes_serve() -> None:
    """The gateway's check reads its /readyz; the worker's its metrics, on the port its
    JETLOOP_METRICS_PORT gives."""
    services = compose()["services"]
    gateway = " ".join(services["gateway"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8080/readyz" in gateway
    assert any(r.path == "/readyz" and r.method == "GET" for r in ROUTES)
    worker = services["worker"]
    port = worker["environment"]["JETLOOP_METRICS_PORT"]
    assert f"http://127.0.0.1:{port}/metrics" in " ".join(worker["healthcheck"]["test"])


def test_the_dockerfile_keeps_its_rules() -> None:
    """Slim Python, the dependencies installed from pyproject.toml before the code is copied
    (a code change rebuilds only the last layers), a user of its own (the uid compose gives
    the secrets to), `jetloop` the entrypoint; what the build does not need is ignored."""
    lines = [
        ln.strip()
        for ln in re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text()).splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    steps = [ln.split(None, 1) for ln in lines]
    assert steps[0] == ["FROM", "python:3.11-slim"]
    kinds = [k for k, _ in steps]
    deps = lines.index("COPY pyproject.toml README.md ./")
    code = lines.index("COPY jetloop ./jetloop")
    assert deps < code
    assert any("pip install ." in ln for ln in lines[deps:code])
    assert any("pip install --no-deps ." in ln for ln in lines[code:])
    users = [arg for k, arg in steps if k == "USER"]
    assert users == ["jetloop"]
    assert "useradd --create-home --uid 10001 jetloop" in (ROOT / "Dockerfile").read_text()
    assert "chown -R 10001:10001 /secrets" in compose()["services"]["credentials"]["command"][0]
    assert kinds.index("USER") > kinds.index("RUN")
    assert ["ENTRYPOINT", '["jetloop"]'] in steps
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".jetloop", "**/node_modules"} <= set(ignored)
