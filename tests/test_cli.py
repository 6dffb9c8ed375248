"""The command line as a user meets it: ``--help`` reads as text, ``run`` works from
a pip install without a config file of its own (the configs ship with the package)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvdist
from kvdist import cli

ROOT = Path(__file__).resolve().parents[1]


def test_help_is_whole_sentences_without_markup():
    out = subprocess.run([sys.executable, "-m", "kvdist", "--help"], capture_output=True, text=True,
                         timeout=60, encoding="utf-8").stdout
    assert "``" not in out and "exits with status 2." in out, out


def test_run_needs_no_config_file_the_configs_ship_with_the_package():
    assert cli._parser().parse_args(["run"]).config == "default"
    assert cli.shipped_configs() == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    for name in cli.shipped_configs():
        path = Path(cli.config_path(name))
        shipped = ROOT / "configs" / f"{name}.yaml"
        assert path.read_text(encoding="utf-8") == shipped.read_text(encoding="utf-8")
        assert Path(kvdist.__file__).parent in path.parents  # inside the package, as a wheel has it
    assert kvdist.load_config(cli.config_path("default")).cache.gpu.blocks == 256


def test_a_config_path_is_taken_as_given_and_an_unknown_name_is_one_mistake(tmp_path):
    assert cli.config_path(str(tmp_path / "mine.yaml")) == str(tmp_path / "mine.yaml")
    assert cli.config_path("configs/h200.yaml") == "configs/h200.yaml"
    with pytest.raises(kvdist.ConfigError, match="no such file, nor a shipped config .*default"):
        cli.config_path("defualt")


def test_an_ascii_locale_reads_the_config_and_escapes_what_it_cannot_print(tmp_path):
    """CI's locale is ASCII: a config holding non-ASCII (a comment, a value) is read as
    UTF-8 whatever the locale, and its mistake is still one line, the value escaped
    (without ``process.printable_anywhere`` the print itself raises)."""
    bad = tmp_path / "bad.yaml"
    default = (ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")
    assert default.count("blocks: 256") == 1
    bad.write_text("# blocks × bytes → the GPU tier\n" + default.replace("blocks: 256", "blocks: ×4"),
                   encoding="utf-8")
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": ""}
    out = subprocess.run([sys.executable, "-m", "kvdist", "run", "--config", str(bad)], env=env,
                         capture_output=True, timeout=120)
    text = (out.stdout + out.stderr).decode("ascii")  # nothing but ASCII came out
    assert out.returncode == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "cache.gpu.blocks" in lines[0] and "\\xd74" in lines[0], text


def test_an_ascii_locale_gets_the_report_with_its_units_escaped():
    """A report's µs on an ASCII stdout: escaped (\\xb5s), not a UnicodeEncodeError."""
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": ""}
    bench = ["bench", "manager", "--requests", "32", "--repeat", "1", "--onboard-blocks", "64"]
    out = subprocess.run([sys.executable, "-m", "kvdist", *bench], env=env, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode("ascii", "replace")[-2000:]
    assert "\\xb5s/step" in out.stdout.decode("ascii"), out.stdout[-2000:]
