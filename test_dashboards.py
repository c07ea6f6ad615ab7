"""dashboards.py: the live dashboard (--report-to tensorboard | wandb) gets what the logs get, at one
step across the phases, on rank 0 alone, and a resume continues it; the plot and --compare; the
summary line."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dashboards
import retireopd as R
from conftest import QUICK, run_cli, crash_instead_of_saving


def test_tracker_records_are_the_log_lines_numbers_at_one_step_across_the_phases():
    cfg = R.Config(model="tiny", iterations=4, teacher_iterations=3)
    steps = R.steps_before_phases(cfg)
    line = {"phase": "student", "iteration": 1, "success": 0.5, "retired": True, "gap": None, "phase_note": "x",
            "nested": {"a": 2, "b": {"c": False}}}
    assert dashboards.tracker_record(steps, "metrics.jsonl", line) == (5, {  # phase 1's 3 updates, then phase 2's 2nd
        "student/success": 0.5, "student/retired": 1.0, "student/nested/a": 2.0, "student/nested/b/c": 0.0})
    assert dashboards.tracker_record(steps, "metrics.jsonl", {"phase": "teacher", "iteration": 2, "loss": -1}) == (
        3, {"teacher/loss": -1.0})
    validation = {"phase": "teacher", "iteration": 0, "panel": "validation", "dorl": 1.0, "overall": 0.25, "n": 4,
                  "skills": True, "seed": 12345, "temperature": 0.4}
    assert dashboards.tracker_record(steps, "eval.jsonl", validation) == (1, {
        "teacher/validation_skills/dorl": 1.0, "teacher/validation_skills/overall": 0.25,
        "teacher/validation_skills/n": 4.0, "teacher/validation_skills/seed": 12345.0,
        "teacher/validation_skills/temperature": 0.4})
    report = {"phase": "student", "iteration": 3, "panel": "report", "overall": 1.0, "skills": False}
    assert dashboards.tracker_record(steps, "eval.jsonl", report) == (7, {"student/report_no_skills/overall": 1.0})
    before = {"phase": "teacher", "iteration": -1, "panel": "validation", "overall": 0.0, "skills": False,
              "before_training": True}  # the validation before any update: step 0, never a negative one
    assert dashboards.tracker_record(steps, "eval.jsonl", before) == (0, {"teacher/validation_no_skills/overall": 0.0})
    retirement = {"event": "retirement", "rule": "adaptive", "retired_at": 2, "decided_after_iteration": 1,
                  "judged_block": 0.2, "progress": -1.0, "competence": 1.1, "val_success": 0.9, "criterion_valid": True}
    assert dashboards.tracker_record(steps, "events.jsonl", retirement) == (5, {
        "student/retirement/retired_at": 2.0, "student/retirement/judged_block": 0.2,
        "student/retirement/progress": -1.0, "student/retirement/competence": 1.1,
        "student/retirement/val_success": 0.9, "student/retirement/criterion_valid": 1.0})
    for event in ({"event": "done", "wall_s": 3.0}, {"event": "memory_estimate", "phase": "phase 1", "gib": {}}):
        assert dashboards.tracker_record(steps, "events.jsonl", event) is None
    grpo = R.dataclasses.replace(cfg, algo="grpo")  # no phase 1: phase 2's validation before training is step 0
    assert dashboards.tracker_record(R.steps_before_phases(grpo), "metrics.jsonl", {"phase": "student", "iteration": 1})[0] == 2


@pytest.mark.parametrize("tracker,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_missing_tracker_package_is_a_one_line_error_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                                                   tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit) as stop:
        R.main(QUICK + ["--env", "webshop", "--report-to", tracker, "--run-dir", str(tmp_path / "run")])
    assert str(stop.value) == (f"retireopd: --report-to {tracker} needs the {tracker} package, not installed here: "
                               f"pip install {tracker}")
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit, match="--report-to: none, tensorboard or wandb"):
        R.parse_config({"model": "tiny", "report_to": "mlflow", "run_dir": str(tmp_path / "other")})


def test_only_rank_0_reports(tmp_path, monkeypatch):
    run = R.Run(R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")}))
    sent = []
    run.tracker = type("Recorder", (), {"log": lambda self, name, record: sent.append((name, record))})()
    run.log("metrics.jsonl", {"phase": "teacher", "iteration": 0, "success": 0.0})
    monkeypatch.setenv("RANK", "1")  # under torchrun, another rank logs the same line: it writes and sends nothing
    run.log("metrics.jsonl", {"phase": "teacher", "iteration": 1, "success": 0.0})
    assert sent == [("metrics.jsonl", {"phase": "teacher", "iteration": 0, "success": 0.0})]
    assert len(R.read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1


def scalars(folder):
    """{tag: [(step, value)]} of every scalar in a TensorBoard log folder, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_gets_every_metrics_line_evaluation_and_the_retirement_and_a_resume_appends(tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt; without it this test cannot run")
    run_dir = tmp_path / "run"  # interrupted where the checkpoint after student iteration 1 would be written
    flags = ["--env", "webshop", "--iterations", "4", "--retire-at", "2", "--report-to", "tensorboard"]
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00001")
    before = scalars(run_dir / "tensorboard")
    assert [step for step, _ in before["student/success"]] == [5, 6]  # phase 1's 4 updates, then phase 2's
    R.main(["--resume", str(run_dir)])  # redoes student iteration 1, then goes on
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # the same folder: a second event file
    logged = scalars(run_dir / "tensorboard")
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    for m in metrics:  # each number of each line, once, at its step (the redone iteration's first try purged)
        step = m["iteration"] + 1 + (4 if m["phase"] == "student" else 0)
        for key in ("success", "loss", "grad_norm", "retired", "gap"):
            if key in m:
                assert [v for s, v in logged[f"{m['phase']}/{key}"] if s == step] == [pytest.approx(float(m[key]))]
    assert [s for s, _ in logged["student/success"]] == [5, 6, 7, 8] and [s for s, _ in logged["teacher/loss"]] == [
        1, 2, 3, 4]
    for e in R.read_jsonl(run_dir / "eval.jsonl"):
        tag = f"{e['phase']}/{e['panel']}_{'skills' if e['skills'] else 'no_skills'}/overall"
        step = e["iteration"] + 1 + (4 if e["phase"] == "student" else 0)  # before training: step 0
        assert [v for s, v in logged[tag] if s == step] == [pytest.approx(e["overall"])]
    assert logged["student/retirement/retired_at"] == [(6, 2.0)]  # decided after student iteration 1


@pytest.mark.slow
def test_wandb_offline_gets_the_same_numbers_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements.txt; without it this test cannot run")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_PROJECT": "retireopd-test"}.items():
        monkeypatch.setenv(key, value)  # no network: the run is written to WANDB_DIR/wandb/offline-run-*
    run_dir = tmp_path / "run"
    flags = ["--env", "webshop", "--algo", "grpo", "--report-to", "wandb"]
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00001")
    wandb.finish()  # what the end of a crashed process does
    R.main(["--resume", str(run_dir)])
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    offline = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # one W&B run, twice (two starts within the same second: wandb adds "-1" to the second folder's name)
    assert len(offline) == 2 and all(re.search(f"-{run_id}(-\\d+)?$", folder.name) for folder in offline), offline
    history, runs = [], []
    for folder in offline:  # read back by wandb's own reader of its transaction log
        (log,) = folder.glob("run-*.wandb")
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120)
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        history += [r["history"]["item"] for r in records if r.get("type") == "history"]
        runs += [r["run"] for r in records if r.get("type") == "run"]
    assert {r["run_id"] for r in runs} == {run_id} and {r["project"] for r in runs} == {"retireopd-test"}
    by_step = {}
    for item in history:
        by_step.setdefault(item["_step"], {}).update(item)
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]  # --algo grpo: no phase 1; before training is step 0
    assert sorted(by_step) == [0, 1, 2, 3]
    for m in metrics:
        for key in ("success", "loss", "grad_norm", "samples"):
            assert by_step[m["iteration"] + 1][f"student/{key}"] == pytest.approx(float(m[key]))
    evaluations = R.read_jsonl(run_dir / "eval.jsonl")
    assert evaluations[0]["iteration"] == -1 and evaluations[0]["before_training"]
    for e in evaluations:
        assert by_step[e["iteration"] + 1][f"student/{e['panel']}_no_skills/overall"] == pytest.approx(e["overall"])


@pytest.mark.slow
def test_plot_is_written_or_explained_without_matplotlib(tmp_path, monkeypatch, capsys):
    run_a, _, _ = run_cli(tmp_path, "a", "--env", "webshop", "--iterations", "3")
    run_b, _, _ = run_cli(tmp_path, "b", "--env", "webshop", "--algo", "grpo+opd")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (run_a / "plot.png").stat().st_size > 10_000  # written at the end of the run
        out = R.main(["--compare", str(run_a), str(run_b)])
        assert out == run_a / "compare.png" and out.stat().st_size > 10_000
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert dashboards.plot_runs([run_a]) is None
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.slow
def test_compare_is_titled_with_every_environment_and_lines_up_phase_two(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    run_a, _, _ = run_cli(tmp_path, "a", "--env", "webshop")  # phase 1 (3 iterations), then phase 2
    run_b, _, _ = run_cli(tmp_path, "b", "--env", "kitchen", "--algo", "grpo")  # phase 2 only
    run_c, _, _ = run_cli(tmp_path, "c", "--env", "webshop", "--teacher-iterations", "2")  # a shorter phase 1
    assert dashboards.plot_runs([run_a, run_c]) == run_a / "compare.png"  # before: a ValueError, blamed on the logs
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    dashboards.plot_runs([run_a, run_b])
    (figure,) = figures
    assert figure._suptitle.get_text() == "2 runs on kitchen and webshop"
    # the validation dots of each student start where phase 2 starts: after the longest phase 1 (the GRPO
    # run's validation before training one step before it)
    first_x = {line.get_label(): min(line.get_xdata()) for line in figure.axes[0].get_lines()
               if line.get_label().endswith("(phase 2)")}
    assert first_x == {"a, no skills (phase 2)": 3, "b, no skills (phase 2)": 2}


def test_run_summary_reads_S_T_the_retirement_and_the_report_panel(tmp_path):
    def write(name, records):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    write("events.jsonl", [{"event": "start"}, {"event": "teacher_ready", "teacher_success": 0.5},
                           {"event": "retirement", "rule": "adaptive", "retired_at": 11, "decided_after_iteration": 10},
                           {"event": "done"}])
    write("eval.jsonl", [{"phase": "teacher", "iteration": 0, "panel": "validation", "skills": True, "overall": 0.1},
                         {"phase": "teacher", "iteration": 2, "panel": "report", "skills": True, "overall": 0.625},
                         {"phase": "student", "iteration": 2, "panel": "report", "skills": False, "overall": 0.75}])
    for phase, stored in (("teacher", 0.5), ("student", 0.6)):  # phase 2 ran with --teacher-success 0.6
        (tmp_path / phase).mkdir()
        (tmp_path / phase / "retireopd.json").write_text(json.dumps({"teacher_success": stored}))
    assert dashboards.run_summary(tmp_path) == ("S_T 0.600; teacher retired from student iteration 11 (adaptive rule); "
                                       "report panel: teacher with skills 0.62, student 0.75")
    write("events.jsonl", [{"event": "teacher_ready", "teacher_success": 0.5}])
    assert "teacher never retired" in dashboards.run_summary(tmp_path)


@pytest.mark.slow
def test_wandb_without_a_login_logs_offline_with_a_note(tmp_path):
    pytest.importorskip("wandb", reason="wandb is in requirements.txt; without it this test cannot run")
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"), WANDB_SILENT="true", WANDB_CONSOLE="off",
               OMP_NUM_THREADS="1")  # no API key anywhere (a fresh process: wandb keeps its settings per process)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "retireopd.py", *QUICK, "--env", "webshop", "--algo", "grpo",
                           "--report-to", "wandb", "--run-dir", str(run_dir), "--iterations", "1"],
                          cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # before: a UsageError traceback, after the folder was written
    assert "W&B cannot log online (No API key configured" in done.stdout and "`wandb sync` uploads" in done.stdout
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


def test_a_plot_over_a_link_writes_inside_the_run_folder(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot is optional: without matplotlib there is nothing to write")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"env": "kitchen", "algo": "grpo", "model": "tiny", "rho": 0.8,
                                                     "window": 2}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"phase": "student", "iteration": 0, "success": 0.5}) + "\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    (run_dir / "plot.png").symlink_to(victim)  # planted after the run's start: before, overwritten with a PNG
    assert dashboards.plot_runs([run_dir]) == run_dir / "plot.png"
    assert victim.read_text() == "another user's file\n"
    assert not (run_dir / "plot.png").is_symlink() and (run_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
