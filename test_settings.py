"""settings.py: every bad flag fails in one line before anything is written (validate_config, its table
of rules; the data folders the flags name), in seconds. (A resume's settings, saved_settings, and the
teacher and run-folder checks are in test_run_folder.py; the model sources in test_model_sources.py.)"""

import pytest

import bench
import retireopd as R
from conftest import HAVE_ALFWORLD, QUICK, one_line_refusal, save_teacher


def test_loss_agg_flags_fail_in_one_line_before_anything_runs(tmp_path):
    for flags, message in ((["--loss-agg", "seq-mean"], "--loss-agg: exact"),
                           (["--micro-batch-rows", "0"], "--micro-batch-rows must be >= 1")):
        with pytest.raises(SystemExit, match=message) as failure:
            R.main(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags])
        assert "\n" not in str(failure.value.code)
    assert not (tmp_path / "x").exists()
    assert R.parse_config({"model": "tiny", "run_dir": str(tmp_path / "y")}).loss_agg == "exact"  # the default


def test_bad_flags_fail_before_any_model_is_loaded(tmp_path):
    for flags, message in ((["--algo", "ppo"], "--algo"), (["--group-size", "1"], "--group-size"),
                           (["--rho", "1.5"], "--rho"), (["--window", "0"], "--window"),
                           (["--eval-every", "0"], "--eval-every"), (["--eval-every", "6"], "--eval-every"),
                           (["--dual-clip", "1"], "--dual-clip"), (["--teacher-success", "0"], "--teacher-success"),
                           (["--opd-mini-batch", "0"], "--opd-mini-batch"), (["--opd-kl-coef", "-1"], "--opd-kl-coef"),
                           (["--kl-coef", "-1"], "--kl-coef"), (["--env", "atari"], "--env"),
                           (["--teacher", str(tmp_path)], "retireopd.json"),
                           (["--retire-at", "2", "--algo", "grpo"], "--retire-at"),
                           (["--retire-at", "99"], "--retire-at"),
                           (["--frozen-dtype", "int8"], "--frozen-dtype"), (["--model", "Qwen2.5-15B"], "alias"),
                           (["--env-workers", "-1"], "--env-workers"),
                           (["--prefill-batch", "-1"], "--prefill-batch"),
                           (["--env", "alfworld", "--alfworld-data", str(tmp_path / "none")],  # (the package first)
                            "alfworld-download" if HAVE_ALFWORLD else "requirements-alfworld.txt"),
                           (["--env", "webshop", "--webshop-data", str(tmp_path)], "items_shuffle_1000.json"),
                           # accepted silently once: nothing trains, an empty panel, all pairs but the first
                           (["--ppo-epochs", "0"], "--ppo-epochs"), (["--eval-episodes", "0"], "--eval-episodes"),
                           (["--history", "-1"], "--history"), (["--keep-checkpoints", "0"], "--keep-checkpoints"),
                           (["--save-every", "-1"], "--save-every"), (["--logprob-chunk", "0"], "--logprob-chunk"),
                           (["--clip-eps", "0"], "--clip-eps"), (["--grad-clip", "0"], "--grad-clip"),
                           (["--success-reward", "0"], "--success-reward"),
                           (["--eval-temperature", "-1"], "--eval-temperature"),
                           (["--weight-decay", "-1"], "--weight-decay")):
        with pytest.raises(SystemExit, match=message) as failure:
            R.main(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags])
        assert "\n" not in str(failure.value.code), flags  # one mistake, one line (--window 0 once gave two)
    assert not (tmp_path / "x").exists()


def test_webshop_data_error_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--webshop-data DIR") as failure:
        R.main(["--model", "tiny", "--env", "webshop", "--webshop-data", str(tmp_path), "--run-dir", str(tmp_path / "x")])
    assert "data_dir or" not in str(failure.value.code)  # the Python argument, not what a user types


def test_algo_opd_needs_a_positive_opd_coef(tmp_path):
    with pytest.raises(SystemExit, match="--algo opd trains on lambda \\* L_OPD alone: --opd-coef must be > 0"):
        R.main(QUICK + ["--run-dir", str(tmp_path / "run"), "--algo", "opd", "--opd-coef", "0"])
    assert not (tmp_path / "run").exists()


def test_batch_tasks_must_split_into_whole_groups_under_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match="--batch-tasks 6: under torchrun each of the 4 processes"):
        R.parse_config({"model": "tiny", "batch_tasks": 6, "run_dir": str(tmp_path)})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="the benchmark runs in one process"):
        bench.main(["--model", "tiny", "--run-dir", str(tmp_path / "b")])


@pytest.mark.parametrize("flag", ["--lr", "--clip-eps", "--opd-coef", "--kl-coef", "--entropy-coef",
                                  "--alignment-threshold", "--rho"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_flag_is_one_line_and_writes_nothing(tmp_path, flag, value):
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--save-every", "1", flag, value],
                     f"^retireopd: {flag} {value}: must be a finite number$")
    assert not (tmp_path / "x").exists()  # --lr inf, before: a checkpoint saved 100% NaN


def test_lr_and_weight_decay_must_keep_adamw_sane(tmp_path):
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--lr", "1e3"], "lr must be < 1 and lr \\* weight")
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--lr", "0.5", "--weight-decay", "2"], "< 1")
    assert not (tmp_path / "x").exists()


def test_contradictory_flags_are_refused_and_unused_ones_noted(tmp_path, capsys):
    teacher = save_teacher(tmp_path / "t")
    for algo in ("skill-grpo", "grpo"):  # before: trained and evaluated nothing / silently ignored the teacher
        one_line_refusal(QUICK + ["--env", "webshop", "--algo", algo, "--teacher", str(teacher), "--run-dir",
                                  str(tmp_path / "x")], f"--teacher: --algo {algo} .* so it would not be used")
    R.parse_config({"model": "tiny", "env": "webshop", "algo": "grpo", "teacher_success": 0.5,
                    "run_dir": str(tmp_path / "y")})
    assert "note: --teacher-success only decides the adaptive retirement: --algo grpo does not use it" in \
        capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--max-turns", "0"], "--max-turns must be >= 1"),  # before: 0 became 15 in silence
    (["--max-prompt-tokens", "-5"], "--max-prompt-tokens must be >= 128"),
    (["--max-prompt-tokens", "1"], "--max-prompt-tokens must be >= 128"),
    (["--mini-batch", "0"], "--mini-batch must be >= 1"),
    (["--seed", str(2**70)], "--seed must be in \\[0, 2\\*\\*32\\)"),  # before: torch's ValueError, a traceback
    (["--seed", "-1"], "--seed must be in"),
    # accepted in silence once: a warm-up that never ends, the random tiny model trained, a worker each 260 MB
    (["--lr-warmup-steps", "-5"], "--lr-warmup-steps must be >= 0"),
    (["--warm-start", "-3"], "--warm-start must be >= 0"),
    (["--env-workers", "100000"], "--env-workers must be between 0"),
    (["--eval-temperature", "1e-45"], "--eval-temperature 1e-45: 0 \\(greedy\\) or at least 0.001"),  # (a crash)
    (["--sampler", "vllm"], "--sampler: eager, static or auto"),
    (["--eval-batch", "0"], "--eval-batch must be >= 1")])
def test_budgets_and_the_seed_are_checked_in_one_line(tmp_path, flags, message):
    one_line_refusal(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags], message)
    assert not (tmp_path / "x").exists()
    assert R.parse_config({"model": "tiny", "max_prompt_tokens": 128, "seed": 2**32 - 1}).seed == 2**32 - 1


def test_alfworld_without_its_package_is_one_line_that_names_its_install(tmp_path, monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # (as a set-up without requirements-alfworld.txt)
                        lambda name, *args: None if name == "alfworld" else real_find_spec(name, *args))
    for flags in ([], ["--show-prompts"]):
        one_line_refusal(["--env", "alfworld", "--run-dir", str(tmp_path / "x"), *flags],
                         r"--env alfworld needs the alfworld package, its own install: pip install -r "
                         r"requirements-alfworld.txt")
    assert not (tmp_path / "x").exists()
