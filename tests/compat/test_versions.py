"""The supported torch releases: pyproject's requirement, the refusal of any other torch before any work, the torch
a report names, and the release list .ci/run tests. Runs on every supported release (.ci/torch-releases)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from hyperdryrun.compat import versions

ROOT = Path(__file__).resolve().parents[2]


def torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return req


def test_pyproject_requires_exactly_the_supported_releases():
    """pip accepts every supported release already installed (so installing the package never replaces it) and
    refuses the releases on either side."""
    spec = torch_requirement().specifier
    supported = (
        "2.11.0",
        "2.11.0+cu130",
        "2.12.1",
        "2.13.0+cpu",
        "2.14.0",
        "2.14.1",
        "2.15.0",
        "2.15.0+cu132",
    )
    for version in supported:
        assert spec.contains(version), version
        assert versions.torch_problem(version) is None, version
    for version in ("2.10.0", "2.10.1+cu128", "2.16.0", "3.0.0"):
        assert not spec.contains(version), version
        assert versions.torch_problem(version) is not None, version
    assert str(spec) == ",".join(sorted(versions.TORCH_REQUIREMENT.split(",")))


def test_the_pinned_release_is_supported():
    (pin,) = re.findall(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert versions.torch_problem(pin) is None and torch_requirement().specifier.contains(pin)


def test_the_installed_torch_is_supported_and_named_as_imported():
    assert versions.torch_problem() is None
    assert versions.installed_version("torch") == torch.__version__
    assert versions.library_versions("no-such-library-xyz") == {
        "torch": torch.__version__,
        "no-such-library-xyz": None,
    }


@pytest.mark.parametrize(
    ("version", "release"), [("2.13.0+cpu", (2, 13)), ("2.15.0.dev20260101", (2, 15)), ("nightly", None)]
)
def test_release_reads_major_and_minor(version, release):
    assert versions.release(version) == release


def test_an_unsupported_torch_is_one_line_naming_the_range(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNSUPPORTED, raising=False)
    line = versions.torch_problem("2.10.0+cu128")
    assert "\n" not in line
    assert (
        line.startswith("torch 2.10.0+cu128 is not supported") and "torch 2.11 to 2.15 (>=2.11,<2.16)" in line
    )
    monkeypatch.setenv(versions.ALLOW_UNSUPPORTED, "1")
    assert versions.torch_problem("2.10.0+cu128") is None
    monkeypatch.setattr(versions, "installed_version", lambda name: None)
    assert (
        versions.torch_problem()
        == "torch is needed and not installed: hyperdryrun supports torch 2.11 to 2.15 (>=2.11,<2.16)"
    )


def test_the_cli_refuses_an_unsupported_torch_before_any_work(monkeypatch, tmp_path, capsys):
    from tests.conftest import cli

    monkeypatch.delenv(versions.ALLOW_UNSUPPORTED, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.10.0")
    out = tmp_path / "out"
    rc, stdout, err = cli(
        ["run", "--model", "llama-tiny", "--seq-len", "16", "--output-dir", str(out)], capsys
    )
    assert rc == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("hyperdryrun: error: torch 2.10.0 is not supported")
    assert not out.exists()  # nothing ran, nothing was written
    # commands that only read files still work: here report's own error about the missing input, not torch's
    rc, _, err = cli(["report", str(tmp_path / "missing")], capsys)
    assert "torch" not in err


# torch as if it were not installed, for a child process: a sitecustomize on PYTHONPATH that wraps every import
# finder so that torch has neither a module spec nor distribution metadata (what pip uninstall leaves).
NO_TORCH = """\
import sys

class Absent:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        return None if name.split(".")[0] == "torch" or find is None else find(name, path, target)
    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        return [d for d in (find(*args, **kwargs) if find else []) if (d.metadata["Name"] or "").lower() != "torch"]
    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
"""


def without_torch(tmp_path: Path, *argv: str, module: str = "hyperdryrun") -> subprocess.CompletedProcess:
    """``python -m module *argv`` in a child process that cannot find torch."""
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])},
    )


def test_without_torch_the_help_prints_and_commands_that_run_a_step_say_torch_is_needed(tmp_path):
    (tmp_path / "probe.py").write_text(
        "import importlib.metadata as m, importlib.util as u\n"
        "assert u.find_spec('torch') is None and m.version('pydantic')\n"
        "try:\n    import torch\nexcept ModuleNotFoundError:\n    pass\nelse:\n    raise SystemExit(1)\n"
        "try:\n    m.version('torch')\nexcept m.PackageNotFoundError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    probe = without_torch(tmp_path, module="probe")
    assert probe.returncode == 0, probe.stderr  # no module, no metadata: as where torch is not installed
    for argv in (["--help"], ["run", "--help"], ["--version"]):
        done = without_torch(tmp_path, *argv)
        assert done.returncode == 0 and done.stderr == "", (argv, done.stderr)
        assert done.stdout.startswith("usage: hyperdryrun" if argv[-1] == "--help" else "hyperdryrun "), argv
    for argv in (
        ["run", "--model", "llama-tiny"],
        ["measure", "--model", "llama-tiny"],
        ["fit", "--model", "llama-tiny"],
        ["torchtitan", "--module", "llama3", "--config", "llama3_debugmodel"],
        ["script", "train.py"],
        ["audit-kernels"],
    ):
        done = without_torch(tmp_path, *argv)
        assert done.returncode == 2 and done.stdout == "", (argv, done.stderr)
        assert done.stderr == (
            "hyperdryrun: error: torch is needed and not installed: hyperdryrun supports "
            f"{versions.supported_range()}\n"
        ), argv
    # the commands that only read files run: here report's own error about the missing input
    done = without_torch(tmp_path, "report", "missing.json")
    assert done.returncode == 2 and "torch" not in done.stderr and "missing.json" in done.stderr


def test_the_python_api_refuses_an_unsupported_torch_before_any_work(monkeypatch):
    import hyperdryrun
    from hyperdryrun.engine import simulate

    monkeypatch.delenv(versions.ALLOW_UNSUPPORTED, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.10.0")
    built = []

    def model_fn():
        built.append(1)
        return torch.nn.Linear(4, 4)

    with pytest.raises(
        versions.UnsupportedTorchError, match=r"^torch 2\.10\.0 is not supported: .*2\.11 to 2\.15"
    ):
        simulate(model_fn, lambda i, device: torch.zeros(2, 4, device=device), world_size=1)
    assert built == []  # nothing was built: the check comes before the world
    assert hyperdryrun.UnsupportedTorchError is versions.UnsupportedTorchError


@pytest.mark.slow
def test_a_report_names_the_torch_it_modelled_and_the_console_shows_it(tmp_path, capsys):
    import json

    from tests.conftest import cli

    out = tmp_path / "out"
    rc, stdout, _ = cli(["run", "--model", "llama-tiny", "--seq-len", "16", "--output-dir", str(out)], capsys)
    assert rc == 0
    md = json.loads((out / "rank_0" / "rank_0_memory.json").read_text())["metadata"]
    assert md["torch_version"] == torch.__version__ and "transformers_version" not in md
    assert stdout.splitlines()[0].endswith(f" · torch {torch.__version__}")


def test_ci_tests_every_other_supported_release():
    """.ci/torch-releases names one release of each supported minor but the pinned one (which the full suite runs)."""
    text = (ROOT / ".ci" / "torch-releases").read_text()
    (listed,) = re.findall(r'^RELEASES="([^"]+)"', text, re.M)
    (pin,) = re.findall(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    (low_major, low), (high_major, high) = versions.SUPPORTED_TORCH
    assert low_major == high_major
    minors = sorted(versions.release(v) for v in [*listed.split(), pin])
    assert minors == [(low_major, m) for m in range(low, high + 1)]


def test_the_readme_and_pyproject_state_the_supported_range():
    """The range a user reads (README) and the one pip enforces (pyproject) are :data:`SUPPORTED_TORCH`'s."""
    (low_major, low), (high_major, high) = versions.SUPPORTED_TORCH
    requirement = f"torch>={low_major}.{low},<{high_major}.{high + 1}"
    assert f'"{requirement}"' in (ROOT / "pyproject.toml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert f"supports torch {low_major}.{low} to {high_major}.{high} (`{requirement}`" in readme
