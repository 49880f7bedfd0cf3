"""Install pinned lock files into a virtual environment, with progress and an ETA.

    python3 tools/install.py --venv .venv -r requirements.lock [-r more.lock] [-e .] [--pip]

Lock files are complete (``pip freeze`` of a working environment), hence ``--no-deps``; pins
the environment already holds are skipped. Two ways to install them:

- uv (the default): pip installs ``uv`` into the new environment (one wheel), then
  ``uv pip install`` fetches, builds (DeepSpeed's sdist) and installs every pin in parallel,
  with the same indexes, find-links, constraints, certificate and timeout as pip's own
  configuration (uv reads none of it; ``uv_options``). Measured on 2 cores with empty caches,
  requirements.lock's 108 pins: uv's own install 13 s, the whole tool 24-36 s (creating the
  environment and installing uv included), against 65-75 s for the pip pieces below. Progress counts
  the wheels uv has unpacked into its cache.
- pip, with ``--pip`` or when uv cannot be had or fails (the reason is printed):
  1. fetch: ``pip wheel --no-deps`` in a few parallel processes; every pin becomes a wheel
     (sdists such as DeepSpeed's are built once);
  2. install: ``pip install --no-deps --no-index --no-compile``, the wheels in batches.

Either way, byte-code is compiled up front only where Python will not write it itself
(PYTHONDONTWRITEBYTECODE set, as on many CI images; the Makefile clears it for its commands):
``compileall`` of all of site-packages on every core. Otherwise each module is compiled the
first time something imports it, once: the demo imports a fraction of the ~20k files (measured
on 2 cores: 60 s to compile them all, most never imported).

Each stage prints done/total, elapsed and an ETA from the rate so far. Standard library only:
it runs before the environment exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import venv
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import cache_from_source
from pathlib import Path

_FETCHING = re.compile(r"^(Collecting|Processing) ")
"""pip's first line for each requirement it fetches (its "Saved" lines all come at the end)."""
FETCHERS = 3
"""Parallel ``pip wheel`` processes."""
BATCHES = 8
"""Install batches: enough for a useful rate, few enough that pip's start-up (~1 s) is small."""
INSTALLERS = 2
"""Parallel ``pip install`` processes."""
UV = "uv==0.13.9"
"""The uv release the default path installs (the one requirements-test.lock pins)."""
_SECTIONS = (":env:", "install", "global")
"""Where ``pip config list`` says an option comes from, highest precedence first: a PIP_*
variable, a config file's ``[install]`` section (pip install's own), its ``[global]`` one.
Files are already merged in that listing (the highest-precedence file wins)."""


class Progress:
    """One stage's progress line: rewritten in place on a terminal, else printed every ~10 s."""

    def __init__(self, stage: str, total: float, unit: str = "") -> None:
        self.stage, self.total, self.unit = stage, max(total, 1e-9), unit
        self.t0 = self._last = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.lock = threading.Lock()

    def show(self, done: float, note: str = "", final: bool = False) -> None:
        with self.lock:
            now = time.monotonic()
            if not (final or self.tty and now - self._last >= 0.2 or now - self._last >= 10):
                return
            self._last = now
            elapsed = now - self.t0
            eta = f"{elapsed / done * (self.total - done):3.0f} s" if done > 0 else "  ? s"
            amount = f"{done:.0f}/{self.total:.0f} {self.unit}" if self.unit else f"{100 * done / self.total:3.0f}%"
            line = f"[install] {self.stage}: {amount}, {elapsed:3.0f} s elapsed, ETA {eta} {note}"
            if self.tty:
                width = shutil.get_terminal_size().columns - 1
                print("\r" + line[:width].ljust(min(width, 79)), end="\n" if final else "", flush=True)
            else:
                print(line, flush=True)


def pins(lock_files: Iterable[Path]) -> list[str]:
    """The ``name==version`` lines of the lock files (comments and options skipped)."""
    found = []
    for path in lock_files:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*\s*==", line):
                found.append(line)
    return found


def project_name(pin: str) -> str:
    return re.sub(r"[-_.]+", "-", pin.split("==", 1)[0]).lower()  # PEP 503 normalisation


def missing(python: str, requirements: list[str]) -> list[str]:
    """The pins the environment does not hold at exactly that version (a rebuild after a lock
    change fetches only what changed)."""
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout.split()
    have = {project_name(line): line.split("==", 1)[1] for line in listed if "==" in line}
    return [pin for pin in requirements if have.get(project_name(pin)) != pin.split("==", 1)[1]]


def fetch_wheels(pip: list[str], requirements: list[str], wheelhouse: Path) -> list[Path]:
    """Every requirement as a wheel in ``wheelhouse``. pip's output is read line by line and
    each requirement it starts fetching advances the count."""
    progress = Progress("fetch", len(requirements), "packages")
    counted = [0]

    def fetch(part: list[str]) -> None:
        cmd = [*pip, "wheel", "--no-deps", "--progress-bar", "off", "-w", str(wheelhouse), *part]
        tail: list[str] = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = [*tail[-30:], line.rstrip()]
                with progress.lock:  # three readers count into one total
                    counted[0] += bool(_FETCHING.match(line))
                building = line.strip().startswith("Building wheel for")
                progress.show(counted[0], f"(building {line.split()[3]})" if building else "")
        if proc.returncode:
            failures.append("\n".join(t for t in tail if not t.startswith("WARNING: Location")))

    failures: list[str] = []
    parts = [requirements[i::FETCHERS] for i in range(min(FETCHERS, len(requirements)))]
    threads = [threading.Thread(target=fetch, args=(part,)) for part in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        sys.exit("pip wheel failed:\n" + "\n\n".join(failures))
    progress.show(len(requirements), final=True)
    return sorted(wheelhouse.glob("*.whl"))


def install_cost(wheel: Path) -> float:
    """Seconds ``pip install --no-compile`` takes for ``wheel``, up to a constant factor: per
    package, per file and per MiB unpacked (fitted on this project's 136 wheels)."""
    with zipfile.ZipFile(wheel) as archive:
        entries = archive.infolist()
    return 0.04 + 0.00025 * len(entries) + 0.003 * sum(e.file_size for e in entries) / 2**20


def batches(costs: dict[Path, float], n: int) -> list[list[Path]]:
    """The wheels in at most ``n`` groups of about equal cost (costliest first)."""
    target = sum(costs.values()) / n
    groups: list[list[Path]] = [[]]
    cost = 0.0
    for wheel in sorted(costs, key=lambda w: -costs[w]):
        if groups[-1] and cost >= target:
            groups.append([])
            cost = 0.0
        groups[-1].append(wheel)
        cost += costs[wheel]
    return groups


def install_wheels(pip: list[str], wheels: list[Path]) -> None:
    """Batches of about equal cost, two pip processes at a time (no two share a package, and
    unpacking waits on the disk as much as on a core)."""
    costs = {wheel: install_cost(wheel) for wheel in wheels}
    progress = Progress("install", sum(costs.values()))
    done = [0.0]

    def install(group: list[Path]) -> None:
        subprocess.run([*pip, "install", "-q", "--no-compile", "--no-deps", "--no-index", *map(str, group)],
                       check=True)
        with progress.lock:
            done[0] += sum(costs[w] for w in group)
        progress.show(done[0])

    with ThreadPoolExecutor(INSTALLERS) as pool:
        list(pool.map(install, batches(costs, BATCHES)))  # list(): re-raises a failed batch
    progress.show(progress.total, final=True)


def pip_settings(python: str) -> dict[str, str]:
    """pip install's effective configuration, as ``pip config list`` shows it: for each
    option, the value of the highest-precedence section that sets it."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    found: dict[str, tuple[int, str]] = {}
    for line in listed:
        key, sep, value = line.partition("=")
        section, _, option = key.rpartition(".")
        if not sep or section not in _SECTIONS:
            continue
        rank = _SECTIONS.index(section)
        if option not in found or rank < found[option][0]:
            found[option] = (rank, value.strip().strip("'\""))
    return {option: value for option, (_, value) in found.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv arguments and environment variables that reach the packages pip would: the same
    index, extra indexes, find-links and constraint files (pip's list options are
    space-separated), certificate and timeout. Every index is searched for every pin, as pip
    does (uv's default stops at the first index that has the package)."""
    args = ["--index-strategy", "unsafe-best-match"]
    if "index-url" in settings:
        args += ["--index-url", settings["index-url"]]
    for option in ("extra-index-url", "find-links", "constraint"):
        for value in settings.get(option, "").split():
            args += [f"--{option}", value]
    env = {}
    if "cert" in settings:
        env["SSL_CERT_FILE"] = settings["cert"]
    if "default-timeout" in settings or "timeout" in settings:
        env["UV_HTTP_TIMEOUT"] = settings.get("timeout", settings.get("default-timeout", ""))
    return args, env


@dataclass(frozen=True)
class Uv:
    """The environment's uv and what it must be told to reach the packages pip would."""

    path: str
    args: list[str]
    env: dict[str, str]
    """``os.environ`` plus ``uv_options``' variables."""


def get_uv(python: str) -> Uv | None:
    """The environment's uv, installed by pip on first use, with pip's configuration read once;
    None when pip cannot install it."""
    uv = Path(python).parent / "uv"
    if not uv.exists():
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", UV], capture_output=True, text=True)
        if done.returncode:
            print(f"[install] pip could not install {UV} ({done.stderr.strip().splitlines()[-1:]}); using pip",
                  flush=True)
            return None
    args, env = uv_options(pip_settings(python))
    return Uv(str(uv), args, {**os.environ, **env})


def uv_install(uv: Uv, python: str, requirements: list[str], venv: Path) -> bool:
    """Fetch, build and install ``requirements`` with uv; False (and why, printed) when it
    failed, so that pip can take over."""
    archives = Path(subprocess.run([uv.path, "cache", "dir"], capture_output=True, text=True, env=uv.env,
                                   check=True).stdout.strip()) / "archive-v0"
    unpacked_before = _count(archives)
    progress = Progress("install", len(requirements), "packages")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=venv) as pinned:
        pinned.write("\n".join(requirements) + "\n")
        pinned.flush()
        cmd = [uv.path, "pip", "install", "--python", python, "--no-deps", "--no-progress", *uv.args, "-r", pinned.name]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=uv.env) as proc:
            # Each wheel uv fetches (or builds) is unpacked into its cache before the install.
            while proc.poll() is None:
                progress.show(min(_count(archives) - unpacked_before, len(requirements) - 1))
                time.sleep(0.5)
            output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        print(f"[install] uv failed, installing with pip instead:\n{output.strip()[-2000:]}", flush=True)
        return False
    progress.show(len(requirements), final=True)
    return True


def install_editable(uv: Uv | None, python: str, project: Path) -> None:
    """``project`` installed editable, without dependencies (by uv when it installed the
    pins: pip would first fetch setuptools into an isolated build environment)."""
    if uv is None:
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(project)], check=True)
        return
    subprocess.run([uv.path, "pip", "install", "-q", "--python", python, *uv.args, "--no-deps", "-e", str(project)],
                   check=True, env=uv.env)


def _count(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def compile_all(python: str) -> None:
    """Byte-compile site-packages on every core; files already compiled are skipped (and not
    counted: the total is what compileall will compile)."""
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    total = sum(not Path(cache_from_source(str(py))).exists() for py in Path(site).rglob("*.py"))
    progress = Progress("compile", total, "files")
    done = 0
    cmd = [python, "-m", "compileall", "-j", "0", site]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("Compiling "):
                done += 1
                progress.show(done)
    # A non-zero exit means some file did not compile (packages ship test data in old syntax):
    # pip ignores those too, and Python compiles what it imports anyway.
    progress.show(total, final=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, required=True, help="the environment (created if missing)")
    parser.add_argument("-r", dest="locks", type=Path, action="append", required=True, help="a lock file")
    parser.add_argument("-e", dest="editable", type=Path, help="a project to install editable, without deps")
    parser.add_argument("--pip", action="store_true", help="install with pip alone, not uv")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    if not (args.venv / "bin" / "python").exists():
        print(f"[install] creating {args.venv}", flush=True)
        venv.create(args.venv, with_pip=True)
    python = str(args.venv / "bin" / "python")
    pip = [python, "-m", "pip"]
    requirements = missing(python, pins(args.locks))
    uv = None if args.pip or not (requirements or args.editable) else get_uv(python)
    if requirements:
        if uv is None or not uv_install(uv, python, requirements, args.venv):
            uv = None
            with tempfile.TemporaryDirectory(dir=args.venv, prefix="wheelhouse-") as tmp:
                install_wheels(pip, fetch_wheels(pip, requirements, Path(tmp)))
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            compile_all(python)  # nothing else would ever write it: every import would recompile
    if args.editable is not None:
        install_editable(uv, python, args.editable)
    print(f"[install] {len(requirements)} packages in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
