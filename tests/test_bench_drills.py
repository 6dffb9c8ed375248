"""``python -m kvdist bench drills`` on one rank: every drill's outcome, and no disk file
left after any of them (scripts/gpu/consensus.sh runs it on four ranks of a GPU)."""

import re

import yaml

from kvdist.bench import drills

from .conftest import make_cfg


def test_drills_on_one_rank(tmp_path, capsys):
    disk = tmp_path / "disk"
    cfg = tmp_path / "drill.yaml"
    cfg.write_text(yaml.safe_dump(make_cfg(cache={"host": {"bytes": 4 * 512},
                                                  "disk": {"path": str(disk), "bytes": 8 * 512}})),
                                                      encoding="utf-8")
    assert drills.main(["--config", str(cfg), "--stall-timeout", "0.5"]) == 0
    out = capsys.readouterr().out
    outcomes = re.findall(r"^\s*0\s+(\S+)", out, flags=re.M)
    assert outcomes == ["KEEP_HOST", "KEEP_HOST", "USE_NO_HOST", "KVDistError:", "ConsensusTimeout:"], out
    assert "gpu+host+disk" in out and "gpu+disk" in out
    assert out.count("disk files left: []") == 5

