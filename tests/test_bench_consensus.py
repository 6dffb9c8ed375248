"""``python -m kvdist bench consensus`` on one rank (the test bed runs it on four)."""

import json

from kvdist.bench import consensus


def test_bench_consensus_json(capsys):
    assert consensus.main(["--rounds", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["ranks"], got["nodes"], got["rounds"], got["config"]) == (1, 1, 3, "small")
    for part in consensus.PARTS:
        assert 0 <= got[part]["median_ms"] <= got[part]["max_ms"], got
    assert got["build"]["median_ms"] > 0 and got["total"]["median_ms"] >= got["build"]["median_ms"]


def test_bench_consensus_table(capsys):
    assert consensus.main(["--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bench consensus: 1 ranks on 1 node(s), 1 rounds, config small CPU cache")
    assert [line.split()[0] for line in out.splitlines()[3:]] == list(consensus.PARTS)
