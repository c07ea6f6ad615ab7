"""Tests of study.py on run folders written by hand: what each column reads, how the claims are
counted, and that finished runs are reused (no run is started here)."""

import json
import os
import sys
from pathlib import Path

import pytest

import study

VARIANT_REPORTS = {"retireopd": 0.9, "grpo+opd": 0.6, "opd": 0.5, "grpo": 0.4, "retire-early": 0.7,
                   "retire-late": 0.6}


def write_jsonl(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def fake_seed(folder: Path, s_t: float, reports: dict, retired_at=8, base=(0.25, 0.06)) -> None:
    """A seed's run folders as retireopd.py leaves them (only what the study reads)."""
    for variant, success in reports.items():
        run = folder / variant
        records = [{"phase": "student", "iteration": k, "panel": "validation", "skills": False, "overall": k / 10}
                   for k in (-1, 2, 5)]
        records.append({"phase": "student", "iteration": 5, "panel": "report", "skills": False, "overall": success})
        events = [{"event": "done"}]
        if variant == "retireopd":
            records = [{"phase": "teacher", "iteration": -1, "panel": "validation", "before_training": True,
                        "skills": True, "overall": base[0]},
                       {"phase": "teacher", "iteration": -1, "panel": "validation", "before_training": True,
                        "skills": False, "overall": base[1]},
                       {"phase": "teacher", "iteration": 2, "panel": "validation", "skills": True, "overall": 0.5},
                       {"phase": "teacher", "iteration": 2, "panel": "report", "skills": True, "overall": 0.7},
                       *records]
            (run / "teacher").mkdir(parents=True)
            (run / "teacher" / "retireopd.json").write_text(json.dumps({"teacher_success": s_t}))
            if retired_at is not None:
                events.insert(0, {"event": "retirement", "retired_at": retired_at})
        write_jsonl(run / "eval.jsonl", records)
        write_jsonl(run / "events.jsonl", events)


def test_seed_row_reads_each_column_from_the_run_folders(tmp_path):
    fake_seed(tmp_path / "seed3", 0.625, VARIANT_REPORTS)
    row = study.seed_row(tmp_path / "seed3")
    assert row == {"base+skills": 0.25, "base": 0.06, "S_T": 0.625, "teacher": 0.7, "retired": 8,
                   **VARIANT_REPORTS}


def test_claims_count_seeds_and_average_margins(tmp_path):
    fake_seed(tmp_path / "seed0", 0.625, VARIANT_REPORTS)
    fake_seed(tmp_path / "seed1", 0.75, {**VARIANT_REPORTS, "retireopd": 0.7, "opd": 0.75}, retired_at=None)
    rows = {seed: study.seed_row(tmp_path / f"seed{seed}") for seed in (0, 1)}
    got = {name: (holds, n, margin) for name, holds, n, margin in study.claims(rows)}
    names = [name for name, _, _ in study.CLAIMS]
    # S_T - base+skills: 0.375, 0.5;  retireopd - grpo+opd: 0.3, 0.1;  S_T - opd: 0.125, 0.0 (at or below: holds)
    # teacher - opd: 0.2, -0.05;  retireopd - S_T: 0.275, -0.05;  retireopd - teacher: 0.2, 0.0 (not above)
    # retireopd - grpo: 0.5, 0.3
    expected = [(2, 0.4375), (2, 0.2), (2, 0.0625), (1, 0.075), (1, 0.1125), (1, 0.1), (2, 0.4)]
    for name, (holds, margin) in zip(names, expected):
        assert got[name][:2] == (holds, 2) and got[name][2] == pytest.approx(margin), name
    table = study.format_table(rows)
    assert "| 1 | 0.25 | 0.06 | 0.75 | 0.70 | - | 0.70 | 0.60 | 0.75 | 0.40 | 0.70 | 0.60 |" in table
    assert "| 1 of 2 | +0.11 |" in table
    # "at" its teacher: within one validation episode (1/48) below counts, two do not
    for opd, holds in ((0.625 + 0.02, 1), (0.625 + 0.042, 0)):
        rows[0]["opd"] = opd
        assert [h for name, h, _, _ in study.claims({0: rows[0]}) if name.startswith("pure distillation")] == [holds]


def test_finished_runs_are_reused_and_other_settings_refused(tmp_path, monkeypatch):
    for seed in (0, 1):
        fake_seed(tmp_path / f"seed{seed}", 0.5, VARIANT_REPORTS)
    monkeypatch.setattr(study.subprocess, "Popen", lambda *a, **k: pytest.fail("a finished run was started"))
    rows = study.main(["--seeds", "0", "1", "--out", str(tmp_path)])
    assert rows[1]["retireopd"] == 0.9 and (tmp_path / "study.md").is_file()
    saved = json.loads((tmp_path / "study.json").read_text())
    assert saved["rows"]["0"]["S_T"] == 0.5
    (tmp_path / "study.json").write_text(json.dumps({**saved, "wall_s": 4000.0}))  # runs of an earlier start
    study.main(["--seeds", "0", "1", "--out", str(tmp_path)])  # nothing to run: the wall time is kept
    assert 4000 <= json.loads((tmp_path / "study.json").read_text())["wall_s"] < 4060
    with pytest.raises(SystemExit, match="other settings"):
        study.main(["--seeds", "0", "--out", str(tmp_path), "--retire-late", "45"])


def test_out_is_resolved_from_where_the_study_starts_and_must_be_a_folder(tmp_path, monkeypatch):
    for seed in (0,):
        fake_seed(tmp_path / "mine" / f"seed{seed}", 0.5, VARIANT_REPORTS)
    monkeypatch.setattr(study.subprocess, "Popen", lambda *a, **k: pytest.fail("a finished run was started"))
    monkeypatch.chdir(tmp_path)  # before: the runs started in the project folder with the relative --out
    study.main(["--seeds", "0", "--out", "mine"])
    assert (tmp_path / "mine" / "study.json").is_file() and not (study.HERE / "mine").exists()
    with pytest.raises(SystemExit, match="study: --out /dev/null is not a folder"):  # before: FileExistsError
        study.main(["--seeds", "0", "--out", "/dev/null"])
    outside = tmp_path / "theirs.md"
    outside.write_text("theirs")
    (tmp_path / "mine" / "study.md").unlink()
    (tmp_path / "mine" / "study.md").symlink_to(outside)
    study.main(["--seeds", "0", "--out", "mine"])  # the table is written beside the link's place, never through it
    assert outside.read_text() == "theirs" and not (tmp_path / "mine" / "study.md").is_symlink()


def test_a_started_run_is_resumed_and_a_new_one_gets_its_flags(tmp_path):
    run = tmp_path / "seed2" / "opd"
    fresh = study.command("opd", 2, run, tmp_path / "seed2" / "retireopd" / "teacher", 8, 40, ["--opd-coef", "1"])
    assert fresh[1:] == [str(study.HERE / "retireopd.py"), "--model", "tiny", "--seed", "2", "--run-dir", str(run),
                         "--algo", "opd", "--teacher", str(tmp_path / "seed2" / "retireopd" / "teacher"),
                         "--opd-coef", "1"]
    assert study.command("retire-late", 2, run, run, 6, 30, [])[-4:] == ["--teacher", str(run), "--retire-at", "30"]
    write_jsonl(run / "events.jsonl", [])
    (run / "config.json").write_text("{}")
    assert study.command("opd", 2, run, run, 6, 30, []) == [sys.executable, str(study.HERE / "retireopd.py"),
                                                            "--resume", str(run)]


def test_teachers_of_another_study_are_reused_and_read(tmp_path, monkeypatch):
    # a lab: phase 2 alone, from the teachers and the base of a finished study, with a flag for every run
    fake_seed(tmp_path / "study" / "seed0", 0.625, VARIANT_REPORTS)
    (tmp_path / "study" / "seed0" / "retireopd" / "tiny_base").mkdir()
    (tmp_path / "study" / "seed0" / "retireopd" / "tiny_base" / "retireopd.json").write_text("{}")
    teacher = tmp_path / "study" / "seed0" / "retireopd" / "teacher"
    lab = tmp_path / "lab"
    assert study.command("retireopd", 0, lab / "seed0" / "retireopd", teacher, 8, 40, ["--rho", "1"], True)[2:] == [
        "--model", "tiny", "--seed", "0", "--run-dir", str(lab / "seed0" / "retireopd"), "--algo", "retireopd",
        "--teacher", str(teacher), "--rho", "1"]
    assert "--teacher" not in study.command("grpo", 0, lab / "seed0" / "grpo", teacher, 8, 40, [], True)
    started = []

    class Finished:  # a run that writes what retireopd.py would, at once
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            run = Path(cmd[cmd.index("--run-dir") + 1])
            assert (run / "tiny_base" / "retireopd.json").is_file()  # the study's base, copied in
            write_jsonl(run / "eval.jsonl", [{"phase": "student", "iteration": 49, "panel": "report", "skills": False,
                                              "overall": 0.75}])
            write_jsonl(run / "events.jsonl", [{"event": "retirement", "retired_at": 12}, {"event": "done"}])

        def poll(self):
            return 0

    monkeypatch.setattr(study.subprocess, "Popen", Finished)
    monkeypatch.setattr(study.time, "sleep", lambda seconds: None)
    rows = study.main(["--seeds", "0", "--out", str(lab), "--teachers", str(tmp_path / "study"),
                       "--variants", "retireopd", "--", "--rho", "1"])
    assert len(started) == 1 and started[0][-4:] == ["--teacher", str(teacher), "--rho", "1"]
    assert rows[0]["S_T"] == 0.625 and rows[0]["base+skills"] == 0.25 and rows[0]["teacher"] == 0.7  # the study's
    assert rows[0]["retireopd"] == 0.75 and rows[0]["retired"] == 12 and rows[0]["grpo"] is None  # the lab's
    with pytest.raises(SystemExit, match="no teacher for seed 1"):
        study.main(["--seeds", "0", "1", "--out", str(tmp_path / "lab2"), "--teachers", str(tmp_path / "study")])


def test_a_lab_script_and_another_studys_base(tmp_path, monkeypatch):
    # --script: every run executes the lab's program; --base-from: phase 1 runs again, from the study's base
    study_dir, lab, script = tmp_path / "study", tmp_path / "lab", tmp_path / "lab_flip.py"
    (study_dir / "seed0" / "retireopd" / "tiny_base").mkdir(parents=True)
    (study_dir / "seed0" / "retireopd" / "tiny_base" / "retireopd.json").write_text("{}")
    script.write_text("import retireopd\nretireopd.main()\n")
    started = []

    class Refused:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)  # the lab's script runs with retireopd.py importable, wherever it lies
            assert kwargs["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(study.HERE)
            raise RuntimeError("stop here")

    monkeypatch.setattr(study.subprocess, "Popen", Refused)
    with pytest.raises(RuntimeError, match="stop here"):
        study.main(["--seeds", "0", "--out", str(lab), "--base-from", str(study_dir), "--script", str(script)])
    (cmd,) = started
    assert cmd[1] == str(script.resolve()) and "--teacher" not in cmd and cmd[cmd.index("--algo") + 1] == "retireopd"
    assert (lab / "seed0" / "retireopd" / "tiny_base" / "retireopd.json").is_file()  # the study's base, copied in
    with pytest.raises(SystemExit, match="--script nowhere.py: no such file"):
        study.main(["--out", str(tmp_path / "other"), "--script", "nowhere.py"])
