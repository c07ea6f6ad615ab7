"""Tests of study.py on run folders written by hand: what each column reads, how the claims are
counted, and that finished runs are reused (no run is started here); and the shipped teachers (current
with the code; and what the code builds: slow, it trains one).

    python study.py --build-teachers      # refresh teachers/ (phase 1 of seeds 0-4, about 3 min on 2 cores)
"""

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import model_sources
import retireopd as R
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


def instant_runs(monkeypatch, base_is_right, events: tuple = ()) -> list:
    """study.py's runs replaced by ones that write at once what retireopd.py would: the student's report (0.75),
    `events` and `done`, and a phase 1's teacher (S_T 0.5); each asserts base_is_right(its tiny_base folder).
    Returns the list their commands are appended to."""
    started = []

    class Finished:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            run = Path(cmd[cmd.index("--run-dir") + 1])
            assert base_is_right(run / "tiny_base")
            write_jsonl(run / "eval.jsonl", [{"phase": "student", "iteration": 49, "panel": "report", "skills": False,
                                              "overall": 0.75}])
            write_jsonl(run / "events.jsonl", [*events, {"event": "done"}])
            if "--teacher" not in cmd:  # phase 1 too: its teacher
                (run / "teacher").mkdir()
                (run / "teacher" / "retireopd.json").write_text(json.dumps({"teacher_success": 0.5}))

        def poll(self):
            return 0

    monkeypatch.setattr(study.subprocess, "Popen", Finished)
    monkeypatch.setattr(study.time, "sleep", lambda seconds: None)
    return started


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
    started = instant_runs(monkeypatch, lambda base: (base / "retireopd.json").is_file(),  # the study's, copied in
                           [{"event": "retirement", "retired_at": 12}])
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


def test_the_shipped_teachers_start_a_lab_from_the_projects_base(tmp_path, monkeypatch):
    # --teachers teachers (and --base-from teachers): a folder of teachers without a base model of its own;
    # each run gets the project's tiny_base/, the base they were trained from, and the table their side
    started = instant_runs(monkeypatch, lambda base: (base / "model.safetensors").read_bytes() ==
                           (study.SHIPPED_BASE / "model.safetensors").read_bytes())
    rows = study.main(["--seeds", "1", "--out", str(tmp_path / "lab"), "--teachers", "teachers", "--variants", "opd"])
    teacher = study.TEACHERS / "seed1" / "retireopd" / "teacher"
    assert started[0][started[0].index("--teacher") + 1] == str(teacher)
    assert rows[1]["S_T"] == json.loads((teacher / "retireopd.json").read_text())["teacher_success"]
    assert rows[1]["opd"] == 0.75 and rows[1]["base+skills"] is not None
    script = tmp_path / "lab_misled.py"
    script.write_text("import retireopd\nretireopd.main()\n")
    study.main(["--seeds", "1", "--out", str(tmp_path / "misled"), "--base-from", "teachers", "--script", str(script),
                "--variants", "retireopd"])  # (phase 1 again, from the same base: lab 6)
    assert "--teacher" not in started[1] and started[1][1] == str(script)


def test_the_shipped_teachers_are_current_with_the_code(tmp_path):
    # the labs start from teachers/ (--teachers teachers) only while each teacher is what --build-teachers
    # trains today: from the shipped base (its key), with the settings phase 1 runs with now, S_T what its
    # validations give, a whole model folder that fits the base; else refresh them (this file's docstring)
    base_key = json.loads((study.SHIPPED_BASE / "retireopd.json").read_text())["key"]
    base, tokenizer = R.load_policy(str(study.SHIPPED_BASE), torch.device("cpu"), torch.float32)
    assert sorted(p.name for p in study.TEACHERS.iterdir() if p.is_dir()) == [f"seed{s}" for s in range(5)]
    for seed in range(5):
        home = study.TEACHERS / f"seed{seed}" / "retireopd"
        assert {p.name for p in home.iterdir()} == {"teacher", "eval.jsonl", "build.json"}, seed  # (no checkpoints)
        built = json.loads((home / "build.json").read_text())
        assert built["flags"] == study.teacher_flags(seed) and built["base_key"] == base_key, \
            f"teachers/seed{seed} was not trained from tiny_base/ by --build-teachers: refresh it"
        today = dataclasses.asdict(R.parse_config(vars(R.build_parser(actions=False).parse_args(
            built["flags"] + ["--run-dir", "unused"]))))
        del today["run_dir"]
        assert built["settings"] == json.loads(json.dumps(today)), \
            f"teachers/seed{seed} was trained with other settings than phase 1 has today: refresh it"
        assert built["settings"]["seed"] == seed and built["settings"]["algo"] == "skill-grpo"
        record = json.loads((home / "teacher" / "retireopd.json").read_text())
        validations = [r["overall"] for r in study.read_jsonl(home / "eval.jsonl") if r["phase"] == "teacher"
                       and r["panel"] == "validation" and r["skills"] and not r.get("before_training")]
        assert record["teacher_success"] == R.teacher_success_rate(validations), seed
        assert record["validations"] == validations[-2:] and record["env"] == "kitchen"
        assert model_sources.teacher_folder_problem(home / "teacher", "kitchen") is None
        weights = (home / "teacher" / "model.safetensors").read_bytes()  # (not damaged on the way: a git filter)
        assert hashlib.sha256(weights).hexdigest() == built["weights_sha256"], seed
        teacher, _ = R.load_policy(str(home / "teacher"), torch.device("cpu"), torch.float32)
        assert model_sources.teacher_fit_problem(teacher, home / "teacher", base, tokenizer) is None
        row = study.seed_row(tmp_path, home.parent)  # what --teachers teachers reads of it
        assert row["S_T"] == record["teacher_success"] and None not in (row["base+skills"], row["base"],
                                                                        row["teacher"]), seed


@pytest.mark.slow
def test_the_shipped_teachers_are_what_the_code_builds(tmp_path):
    # seed 0's teacher trained again by this code (--build-teachers, into tmp_path), against the shipped one.
    # Not weight by weight: on another CPU the sums round otherwise and RL amplifies it, so 24 iterations of
    # phase 1 take another path. By what it does: both are teachers (S_T well above the base model with
    # skills) of about the same strength. Robust because the margins are wider than the spread over five
    # seeds, five paths from the same base (S_T 0.50-0.71 and 0.33-0.53 above base+skills, the report
    # 0.50-0.72), and a phase 1 that learns nothing fails both (tried: 2 iterations gave S_T 0.19, below
    # base+skills, 0.21 on seed 0). Measured on the machine that built them: bit-identical.
    study.build_teachers([0], 1, tmp_path / "runs", tmp_path / "teachers")
    built = study.seed_row(tmp_path / "nowhere", tmp_path / "teachers" / "seed0")
    shipped = study.seed_row(tmp_path / "nowhere", study.TEACHERS / "seed0")
    same = (tmp_path / "teachers" / "seed0" / "retireopd" / "teacher" / "model.safetensors").read_bytes() == \
        (study.TEACHERS / "seed0" / "retireopd" / "teacher" / "model.safetensors").read_bytes()
    side = ("base+skills", "S_T", "teacher")
    print(f"built {[built[k] for k in side]}, shipped {[shipped[k] for k in side]} ({', '.join(side)}); weights "
          f"bit-identical: {same}")
    assert abs(built["base+skills"] - shipped["base+skills"]) <= 0.1  # the same base, evaluated by this code
    for row in (built, shipped):
        assert row["S_T"] >= row["base+skills"] + 0.25 and row["teacher"] >= row["base+skills"] + 0.25, \
            [row[k] for k in side]
    assert abs(built["S_T"] - shipped["S_T"]) <= 0.25 and abs(built["teacher"] - shipped["teacher"]) <= 0.25
