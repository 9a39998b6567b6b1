"""coat against the oldest transformers release its range admits (issue 26 item 5).

The suite runs with whatever transformers pip installs today (the newest in range); this test
installs the lower bound of pyproject.toml's range (with the huggingface-hub and tokenizers it
pins) into a temporary folder that shadows the installed ones, and runs the suites that exercise
the code coupled to transformers' internals (coat's forwards of decoder layers, attention and
causal LMs; generate() and its cache; PEFT around converted models) against it in a subprocess.
Needs PyPI (CI has it); a failed download fails the test, naming the cause.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITES = ["tests/python/test_generate.py", "tests/python/test_convert.py", "tests/python/test_peft.py"]
# transformers 5.0's own pins (its METADATA): the installed, newer releases are outside them; and
# what huggingface-hub 1.x imports that 2.x does not (httpx and its dependencies), all pure Python.
COMPANIONS = ["huggingface-hub>=1.3,<2", "tokenizers>=0.22,<=0.23.0", "httpx", "httpcore", "h11", "anyio", "certifi",
              "idna", "sniffio"]


def oldest_transformers() -> str:
    spec = re.search(r'"transformers>=([0-9.]+),', (REPO / "pyproject.toml").read_text())
    assert spec, "pyproject.toml names no transformers>=X lower bound"
    return spec.group(1)


def test_oldest_transformers_in_range_runs_the_coupled_suites(tmp_path: Path) -> None:
    version = oldest_transformers()
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(target), f"transformers=={version}", *COMPANIONS],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, f"could not install transformers=={version} from PyPI:\n{pip.stderr[-2000:]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    found = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, env=env, cwd=REPO)
    from packaging.version import Version

    assert Version(found.stdout.strip()) == Version(version), found.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=1500)
    assert run.returncode == 0, f"with transformers {version}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert re.search(r"\d+ passed", run.stdout)
