"""bench.py: the benchmark runs and writes its report (slow)."""

import json

import pytest

import bench


@pytest.mark.slow
def test_benchmark_runs_and_writes_its_report(tmp_path, capsys):
    bench.main(["--model", "tiny", "--env", "webshop", "--batch-tasks", "1", "--group-size", "2",
                "--max-response-tokens", "4", "--run-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    # the tiny model's log-prob peaks are noise on a CPU (they were once printed as a ratio of -183105)
    assert report["logprob_memory_ratio"] is None and "too small to measure" in capsys.readouterr().out
    assert report["sequences"] == 2 and report["new_tokens"] == 4
    assert set(report["tokens_per_s"]) == {f"{who}_{stage}" for who in ("ours", "plain")
                                           for stage in ("generate", "update", "logprob")}
    # measured figures, not asserted targets; each ratio is ours / plain in tokens per second
    # (log-probs: both score the same tokens, so also plain time / ours)
    speed = report["tokens_per_s"]
    for stage, key in (("generate", "rollout_speed_ratio"), ("update", "update_speed_ratio"),
                       ("logprob", "logprob_speed_ratio")):
        assert report[key] == pytest.approx(speed[f"ours_{stage}"] / speed[f"plain_{stage}"], rel=1e-2, abs=1e-3), key
