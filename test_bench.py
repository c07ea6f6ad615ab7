"""bench.py: the GPU probe runs on the CPU at toy sizes, reports every figure and projects every case; the
comparison with plain Hugging Face calls (--versus-plain) runs and writes its report (slow)."""

import json
import math

import pytest

import bench


def test_the_probe_runs_on_cpu_at_toy_sizes_and_reports_every_figure(tmp_path, capsys):
    bench.main(["--run-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["model"] == "tiny" and report["sizes"]["rows"] == bench.CPU_SIZES.rows
    rows, small, (narrow, wide) = (report["sizes"][k] for k in ("rows", "small_rows", "widths"))
    shapes = {f"{rows}x{narrow}", f"{small}x{narrow}", f"{rows}x{wide}"}
    for sampler in bench.SAMPLERS:
        assert set(report["decode"][sampler]) == shapes
        for figures in report["decode"][sampler].values():
            # a difference of two timings of a few toy tokens: on a busy CPU it may come out negative
            assert math.isfinite(figures["ms_per_step"]) and figures["prefill_tokens_per_s"] > 0
        gap = report["decode"][sampler][f"{rows}x{narrow}"]["gap"]
        assert 0 <= gap["mean"] <= gap["max"] < 1e-4  # fp32 on CPU: the sampler's log-probs are the scorer's
    training = report["training"]
    assert min(training["scoring_tokens_per_s"].values()) > 0 and training["update_s_per_1k_tokens"] > 0
    assert report["head"] is None  # (fp32 against TF32: on a GPU only)
    assert set(report["memory"]) == {"rollout_eager", "rollout_static", "first_update"}
    for sampler in bench.SAMPLERS:  # every row of docs/cost.md's table, projected
        projected = report["projection"][sampler]
        assert [(p["env"], p["case"]) for p in projected] == [(w.env, w.case) for w in bench.WORKLOADS]
        for p in projected:
            assert p["iteration_total_s"] == pytest.approx(sum(p["iteration_s"].values()), abs=0.3)
            assert p["run_h"] == pytest.approx(sum(p["phase_h"]), abs=0.1) and p["evaluation_h"] > 0
    out = capsys.readouterr().out
    assert "GPU probe of tiny on cpu" in out and "projection for B*G = 128" in out
    assert out.count("alfworld upper bound") == len(bench.SAMPLERS)


def test_the_report_is_never_written_through_a_link(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("theirs")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "benchmark.json").symlink_to(outside)
    with pytest.raises(SystemExit, match="benchmark.json is a link to"):  # refused before anything runs
        bench.main(["--run-dir", str(run_dir)])
    (run_dir / "benchmark.json").unlink()
    bench.write_report({"figure": 1.0}, run_dir)
    (run_dir / "benchmark.json").unlink()
    (run_dir / "benchmark.json").symlink_to(outside)  # (planted after the start): replaced, not followed
    bench.write_report({"figure": float("nan")}, run_dir)
    assert outside.read_text() == "theirs" and not (run_dir / "benchmark.json").is_symlink()
    assert json.loads((run_dir / "benchmark.json").read_text()) == {"figure": None}  # no NaN is ever saved


def test_the_projection_counts_the_evaluation_batches_and_the_decode_step():
    sizes = bench.GPU_SIZES
    decode = {f"{r}x{w}": {"ms_per_step": ms, "prefill_tokens_per_s": 1e9}
              for (r, w), ms in {(128, 600): 20.0, (8, 600): 6.0, (128, 2000): 40.0}.items()}
    training = {"scoring_tokens_per_s": {"policy": 1e12, "teacher": 1e12}, "update_s_per_1k_tokens": 0.0}
    work = bench.WORKLOADS[0]._replace(env_s_per_turn=0.0, env_reset_s=0.0)  # ALFWorld: 50 turns of 512 steps
    assert bench.step_ms(decode, sizes, 128, 1300) == pytest.approx(30.0)  # halfway from 600 to 2000
    assert bench.step_ms(decode, sizes, 68, 600) == pytest.approx(13.0)  # halfway from 8 rows to 128
    cfg = bench.R.Config(model="random:Qwen2.5-1.5B", iterations=150, eval_every=5, eval_batch=256)
    projected = bench.project(decode, training, sizes, work, cfg)
    step = bench.step_ms(decode, sizes, 128, 373 + 256)  # phase 2: the student's prompt, half the answer cached
    assert projected["iteration_s"]["decode"] == pytest.approx(50 * 512 * step / 1000, abs=0.1)
    # a launch-bound step (20 ms at any batch): a lock-step batch of the panel costs 50 x 512 x 20 ms = 512 s.
    # --eval-batch 256: phase 1 validates 31 times with and without skills, the 140 games in one batch each, and
    # reports the 274 in two; phase 2 validates 30 times and reports: (31 x 2 + 2 + 30 + 2) x 512 s = 13.65 h.
    # --eval-batch 128: every validation takes two batches, a report three: (31 x 4 + 3 + 60 + 3) x 512 s = 27.02 h
    flat = {shape: dict(figures, ms_per_step=20.0) for shape, figures in decode.items()}
    for eval_batch, hours in ((256, 13.65), (128, 27.02)):
        projected = bench.project(flat, training, sizes, work, bench.R.dataclasses.replace(cfg, eval_batch=eval_batch))
        assert projected["evaluation_h"] == pytest.approx(hours, abs=0.01)


@pytest.mark.slow
def test_the_comparison_with_plain_calls_runs_and_writes_its_report(tmp_path, capsys):
    bench.main(["--versus-plain", "--model", "tiny", "--env", "webshop", "--batch-tasks", "1", "--group-size", "2",
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
