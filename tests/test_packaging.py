"""The package as a user installs it: a wheel, installed into a fresh virtual environment that cannot
see this source tree, run from another directory (offline: the environment reuses the dependencies
already installed in the test's own one through a ``.pth`` line, added after the install so pip
never sees, let alone touches, the editable install there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120


def _env() -> dict[str, str]:
    """No PYTHONPATH (the suite points it at the checkout) and nothing that names a rank."""
    drop = ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1"}


def _check(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """Build the wheel from a copy of the sources (the build leaves nothing in the checkout), install
    it into a new venv with ``pip --python NEW install --no-deps --no-index``, then let that venv see
    the current one's site-packages (torch, lightning, hydra, ...)."""
    base = tmp_path_factory.mktemp("packaging")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "lightning_3d", src / "lightning_3d", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = base / "wheels"
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels), str(src)], base)
    (wheel,) = wheels.glob("lightning_3d-*.whl")

    venv = base / "venv"
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)], base)
    python = venv / "bin" / "python"
    _check([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)], base)
    site = Path(_check([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], base).stdout.strip())
    (site / "zz_reuse_test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    work = base / "elsewhere"  # not the checkout: nothing there to import by accident
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "site": site, "work": work}


def test_the_wheel_carries_the_configs_and_the_license(installed) -> None:
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "lightning_3d/conf/config.yaml" in names
    assert "lightning_3d/conf/model/bloom_176b.yaml" in names and "lightning_3d/conf/cluster/jean_zay_bloom.yaml" in names
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = zipfile.ZipFile(installed["wheel"]).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text and "License-File: LICENSE" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_installed_wheel_plans_from_another_directory(installed) -> None:
    where = _check([str(installed["python"]), "-c", "import lightning_3d; print(lightning_3d.__file__)"], installed["work"])
    module = Path(where.stdout.strip())
    assert module.is_relative_to(installed["site"]), module
    assert not module.is_relative_to(ROOT), module
    proc = _check([str(installed["venv"] / "bin" / "lightning-3d"), "plan", "model=bloom_176b", "cluster=jean_zay_bloom", "--top", "3"], installed["work"])
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("176.2B parameters"), proc.stdout
    assert any(line.strip().startswith("1 ") for line in lines), proc.stdout  # a ranked layout


def test_installed_version(installed) -> None:
    proc = _check([str(installed["venv"] / "bin" / "lightning-3d"), "--version"], installed["work"])
    assert proc.stdout.strip() == "lightning-3d 0.1.0"


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path) -> None:
    """``lightning-3d --help | head -1``: the reader is gone before the command writes; no traceback."""
    env = _env() | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_3d.apps.cli", "--help"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader quits at once (head -1 after its line)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT) == 141 and err == "", err
