"""The command line as a user meets it: ``--help`` reads as text, ``run`` works from
a pip install without a config file of its own (the configs ship with the package)."""

import subprocess
import sys
from pathlib import Path

import pytest

import kvdist
from kvdist import cli

ROOT = Path(__file__).resolve().parents[1]


def test_help_is_whole_sentences_without_markup():
    out = subprocess.run([sys.executable, "-m", "kvdist", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "``" not in out and "exits with status 2." in out, out


def test_run_needs_no_config_file_the_configs_ship_with_the_package():
    assert cli._parser().parse_args(["run"]).config == "default"
    assert cli.shipped_configs() == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    for name in cli.shipped_configs():
        path = Path(cli.config_path(name))
        assert path.read_text() == (ROOT / "configs" / f"{name}.yaml").read_text()
        assert Path(kvdist.__file__).parent in path.parents  # inside the package, as a wheel has it
    assert kvdist.load_config(cli.config_path("default")).cache.gpu.blocks == 256


def test_a_config_path_is_taken_as_given_and_an_unknown_name_is_one_mistake(tmp_path):
    assert cli.config_path(str(tmp_path / "mine.yaml")) == str(tmp_path / "mine.yaml")
    assert cli.config_path("configs/h200.yaml") == "configs/h200.yaml"
    with pytest.raises(kvdist.ConfigError, match="no such file, nor a shipped config .*default"):
        cli.config_path("defualt")
