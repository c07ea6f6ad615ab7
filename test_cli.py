"""retireopd.py's command line: the bare command is the offline demo and a real model gets the paper's
protocol; --show-prompts prints the student's and the teacher's first prompt, and says a data problem in
one line."""


import pytest

import retireopd as R
from conftest import needs_alfworld, one_line_refusal


def test_the_bare_command_is_the_offline_demo_and_a_real_model_gets_the_papers_protocol(tmp_path):
    demo = R.parse_config({"run_dir": str(tmp_path / "demo")})
    assert (demo.model, demo.env, demo.warm_start, demo.opd_coef) == ("tiny", "kitchen", 500, 3.0)
    paper = R.parse_config({"model": "Qwen2.5-1.5B", "run_dir": str(tmp_path / "paper")})
    assert (paper.env, paper.iterations, paper.lr, paper.opd_coef, paper.warm_start) == ("alfworld", 150, 1e-6, 0.01, 0)
    assert (paper.mini_batch, paper.opd_mini_batch, paper.window, paper.rho) == (256, 128, 5, 0.9)
    assert not (tmp_path / "demo").exists() and not (tmp_path / "paper").exists()  # parsing writes nothing


@pytest.mark.parametrize("env", ["kitchen", "webshop", pytest.param("alfworld", marks=needs_alfworld)])
def test_show_prompts_prints_the_students_and_the_teachers_first_prompt_and_writes_nothing(tmp_path, capsys, env):
    run_dir = tmp_path / "run"
    assert R.main(["--show-prompts", "--env", env, "--run-dir", str(run_dir)]) is None
    out = capsys.readouterr().out
    student, teacher = out.split("===== teacher")[0], "===== teacher" + out.split("===== teacher")[1]
    assert student.startswith("===== student (s_t)") and "<|im_start|>user" in student and "<|im_start|>assistant" in student
    assert "Skills for this task" not in student and "Skills for this task" in teacher
    # the teacher's prompt is the student's with the skill block in front of the same content
    student_text = student.split("=====\n", 1)[1].split("<|im_start|>user\n", 1)[1]
    assert teacher.split("=====\n", 1)[1].rstrip().endswith(student_text.rstrip())
    assert not run_dir.exists()


def test_show_prompts_says_a_data_problem_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as stop:
        R.main(["--show-prompts", "--env", "webshop", "--webshop-data", str(tmp_path / "none"),
                "--run-dir", str(tmp_path / "run")])
    assert str(stop.value).startswith("retireopd: WebShop data folder") and "\n" not in str(stop.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, match", [
    (["--resume", ""], '--resume "": an empty path'),
    (["--plot", ""], '--plot "": an empty path'),
    (["--compare", "runs/a", ""], '--compare "": an empty path'),
    (["--run-dir", ""], '--run-dir "": an empty path'),
    (["--teacher", ""], '--teacher "": an empty path'),
    (["--webshop-data", ""], '--webshop-data "": an empty path'),
])
def test_an_empty_path_is_refused_in_one_line_and_starts_nothing(tmp_path, monkeypatch, flags, match):
    monkeypatch.chdir(tmp_path)  # (before: --resume "" and --plot "" started the demo here, --run-dir "" ran here)
    one_line_refusal(flags, match)
    assert list(tmp_path.iterdir()) == []


def test_resume_given_a_file_or_another_run_dir_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one_line_refusal(["--resume", str(tmp_path / "config.json")], "is a file: give the run's folder")
    one_line_refusal(["--resume", str(tmp_path), "--run-dir", str(tmp_path / "other")],
                     "continues the run in its own folder: drop --run-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
