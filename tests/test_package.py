"""The package's metadata: one version number, the licence, the entry point."""
import importlib.metadata
import re
from pathlib import Path

import dmuon

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def test_the_version_is_written_once_and_the_installed_metadata_has_it():
    assert not re.search(r"^version\s*=\s*\"", PYPROJECT, re.M)  # not in [project]: dynamic
    assert 'dynamic = ["version"]' in PYPROJECT and 'version = {attr = "dmuon.__version__"}' in PYPROJECT
    assert importlib.metadata.version("dmuon") == dmuon.__version__


def test_the_licence_and_the_cli_are_declared():
    assert 'license = "MIT"' in PYPROJECT and 'license-files = ["LICENSE"]' in PYPROJECT
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["dmuon-ckpt"] == "dmuon.dcp.cli:main"
