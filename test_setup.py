"""The README's set-up installs from wheels alone, with no compiler, on every platform a class brings: uv
resolves requirements.txt for each (platform, Python) pair with --no-build, as pip would choose there (PyPI,
not this machine's own wheels). ALFWorld, which builds its planner, is its own install
(requirements-alfworld.txt) and does not resolve so. Skipped without uv (`pip install uv`) or a registry.

    python -m pytest -q test_setup.py          # about 80 s on the 2-core machine (12 resolutions, at once)
"""

import os
import re
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PLATFORMS = {  # uv's names; macOS 14 is the oldest torch 2.13's Apple-silicon wheels support
    "macOS arm64": "aarch64-apple-darwin", "Windows x64": "x86_64-pc-windows-msvc",
    "Linux x86-64": "x86_64-unknown-linux-gnu", "Linux aarch64": "aarch64-unknown-linux-gnu",
}
PYTHONS = ("3.11", "3.12", "3.13")

pytestmark = pytest.mark.slow  # (the registry, over the network)


def resolve(requirements: Path, platform: str, python: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("uv"), "pip", "compile", "--no-build", "--quiet", "--no-header",
                           "--python-platform", platform, "--python-version", python, str(requirements)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0"})


@pytest.fixture(scope="module")
def registry():
    if shutil.which("uv") is None:
        pytest.skip("uv is not installed (`pip install uv`)")
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except OSError as error:
        pytest.skip(f"PyPI cannot be reached ({error})")


def test_the_setup_resolves_from_wheels_alone_on_every_platform_and_python_and_alfworld_does_not(registry):
    pairs = [(name, python) for name in PLATFORMS for python in PYTHONS]
    jobs = [(HERE / "requirements.txt", PLATFORMS[name], python) for name, python in pairs]
    jobs.append((HERE / "requirements-alfworld.txt", PLATFORMS["Linux x86-64"], "3.12"))  # (at once, with the rest)
    with ThreadPoolExecutor(len(jobs)) as pool:
        *done, alfworld = pool.map(lambda job: resolve(*job), jobs)
    failed = {pair: result.stderr.strip()[-400:] for pair, result in zip(pairs, done) if result.returncode != 0}
    assert not failed, failed
    for (name, python), result in zip(pairs, done):  # what the README says each gets
        pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", result.stdout, re.MULTILINE))
        assert pins["torch"] == "2.13.0" and pins["transformers"] == "5.24.0", (name, python)
        assert "alfworld" not in pins and "textworld" not in pins
        assert ("nvidia-cublas" in pins) == name.startswith("Linux"), (name, python)  # PyPI's Linux torch: CUDA
    # ALFWorld is its own install: textworld[pddl] (its planner) and jericho build from source
    assert re.fullmatch(r"alfworld==0\.4\.2", "\n".join(
        line for line in (HERE / "requirements-alfworld.txt").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")))
    assert alfworld.returncode != 0 and "no usable wheels" in alfworld.stderr
