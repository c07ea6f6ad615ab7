"""The run folder, against an operator on a flaky cluster and a hostile colleague on a shared disk:
resume after a kill, a crash or a signal without losing or repeating a line; damaged checkpoints and
logs; read-only and full disks; no code from a pickle; one process per folder; a resume that trains
on what the run started with; no NaN ever saved; the teacher checked against its student; and every
bad value in one line.

Each test fails on the code before its guard existed. Fast ones run in seconds; those with
subprocesses or whole runs are marked slow."""

import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kitchen_env
import model_sources
import repairs
import retireopd as R
import run_folder
import webshop_env
from common import checkpoint_folders
from conftest import (
    small_cfg, QUICK, run_cli, phases, comparable, crash_instead_of_saving, one_line_refusal,
    save_teacher,
)


# --- resume after a kill, a crash, a signal ----------------------------------------------------------


@pytest.mark.slow
def test_sigkill_in_phase_two_then_resume_loses_and_repeats_nothing(tmp_path):
    import subprocess
    import time as time_module
    flags = QUICK + ["--env", "webshop", "--iterations", "4"]
    reference = tmp_path / "uninterrupted"
    R.main(flags + ["--run-dir", str(reference)])
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "retireopd.py", *flags, "--run-dir", str(killed)],
                               cwd=Path(__file__).parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # as this process: same sums
    deadline = time_module.time() + 300
    while time_module.time() < deadline and process.poll() is None:  # kill once phase 2 has checkpoints
        if any(m["phase"] == "student" and m["iteration"] >= 1 for m in R.read_jsonl(killed / "metrics.jsonl")):
            process.kill()
            break
        time_module.sleep(0.05)
    process.wait()
    assert process.returncode != 0, "the run finished before it could be killed"
    R.main(["--resume", str(killed)])
    metrics = R.read_jsonl(killed / "metrics.jsonl")
    assert phases(metrics) == [(p, k) for p in ("teacher", "student") for k in range(4)]
    # the same seed gives the same run: every logged value but the timings, and the final weights
    assert comparable(metrics) == comparable(R.read_jsonl(reference / "metrics.jsonl"))
    ours = R.load_policy(str(killed / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    theirs = R.load_policy(str(reference / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    events = [e["event"] for e in R.read_jsonl(killed / "events.jsonl")]
    assert "resume" in events and events[-1] == "done"


def test_resume_before_the_first_checkpoint_starts_over_without_duplicates(tmp_path, monkeypatch):
    run_dir = tmp_path / "early"
    # --save-every 0: the first checkpoint would be the last iteration's; the run dies there instead
    crash_instead_of_saving(monkeypatch, run_dir, ["--env", "webshop", "--algo", "grpo", "--save-every", "0"],
                            lambda name: name.startswith("checkpoints/"))
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    R.main(["--resume", str(run_dir)])
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    validations = [(e["iteration"], e["skills"]) for e in R.read_jsonl(run_dir / "eval.jsonl")
                   if e["panel"] == "validation"]
    assert validations == [(k, False) for k in (-1, 0, 1, 2)]  # the one before training too, once
    with pytest.raises(SystemExit, match="--group-size"):  # a resume may not change the config
        R.main(["--resume", str(run_dir), "--group-size", "4"])
    assert R.resume_config(str(run_dir), {"env_workers": 3}).env_workers == 3  # only how it runs
    assert R.resume_config(str(run_dir), {"prefill_batch": 4}).prefill_batch == 4  # e.g. after running out of memory


# --- what a folder holds; damaged checkpoints and logs; disks ----------------------------------------


def folder_snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_folder_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    run_dir, _, _ = run_cli(tmp_path, "R", "--env", "webshop")
    before = folder_snapshot(run_dir)
    refusal = f"retireopd: {run_dir} holds a run: `--resume {run_dir}` continues it, or choose another `--run-dir`"
    # another run (once: its student distilled from the WebShop teacher), then the same command twice
    for flags in (["--env", "alfworld", "--iterations", "4"], ["--env", "webshop"]):
        with pytest.raises(SystemExit) as failure:
            R.main(QUICK + ["--run-dir", str(run_dir), *flags])
        assert failure.value.code == refusal
    assert folder_snapshot(run_dir) == before  # config, logs, checkpoints, teacher: untouched
    assert json.loads((run_dir / "run.json").read_text())["env"] == "webshop"  # what the folder holds
    legacy = tmp_path / "older"  # a run folder written before run.json existed
    legacy.mkdir()
    (legacy / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="holds a run"):
        R.main(QUICK + ["--env", "webshop", "--run-dir", str(legacy)])


@pytest.mark.slow
def test_a_resume_after_retirement_keeps_the_distilling_phase_protocol(tmp_path, monkeypatch):
    # phase 2 keeps --opd-mini-batch (and no KL) after its teacher is retired, also when a resume
    # finds the teacher retired and loads none. At most 2 x 2 x 2 = 8 turn-samples per iteration:
    # one optimizer step with --opd-mini-batch 8, one per sample with --mini-batch 1.
    flags = ["--env", "webshop", "--iterations", "4", "--retire-at", "1", "--batch-tasks", "2",
             "--mini-batch", "1", "--opd-mini-batch", "8"]
    reference = tmp_path / "uninterrupted"
    R.main(QUICK + ["--run-dir", str(reference), *flags])
    crashed = tmp_path / "crashed"
    crash_instead_of_saving(monkeypatch, crashed, flags, lambda name: name.endswith("1-student-00002"))
    R.main(["--resume", str(crashed)])
    ours, theirs = R.read_jsonl(crashed / "metrics.jsonl"), R.read_jsonl(reference / "metrics.jsonl")
    student = [m for m in ours if m["phase"] == "student"]
    assert [m["teacher_active"] for m in student] == [True, False, False, False]
    assert all(m["optimizer_steps"] == 1 and "kl_ref" not in m for m in student)
    assert comparable(ours) == comparable(theirs)


def test_resume_checks_the_environment_of_the_runs_own_teacher(tmp_path):
    run_dir = tmp_path / "stopped"
    at = QUICK.index("--teacher-success")
    without_s_t = QUICK[:at] + QUICK[at + 2:]
    with pytest.raises(SystemExit, match="S_T = 0"):  # the random teacher: phase 1 ends, phase 2 cannot start
        R.main(without_s_t + ["--env", "kitchen", "--run-dir", str(run_dir)])
    stored = json.loads((run_dir / "teacher" / "retireopd.json").read_text())
    (run_dir / "teacher" / "retireopd.json").write_text(json.dumps({**stored, "env": "alfworld"}))  # another env's
    with pytest.raises(SystemExit, match="trained on alfworld, this run is --env kitchen"):
        R.main(["--resume", str(run_dir), "--teacher-success", "0.5"])


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    run_dir, _, _ = run_cli(tmp_path, "finished", "--env", "webshop", "--algo", "grpo")
    before = folder_snapshot(run_dir)
    capsys.readouterr()
    assert R.main(["--resume", str(run_dir)]) == run_dir  # exits 0
    said = capsys.readouterr().out
    assert said == f"[retireopd] {run_dir} already finished: nothing to resume (its outputs are there)\n"
    assert folder_snapshot(run_dir) == before  # no second evaluation, no second `done`
    # an older version's config.json held the rollout temperature, which could only be 1: still this version's
    saved = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**saved, "temperature": 1.0}))
    assert R.main(["--resume", str(run_dir)]) == run_dir
    (run_dir / "config.json").write_text(json.dumps({**saved, "temperature": 0.7}))
    with pytest.raises(SystemExit, match=r"settings this version of retireopd.py does not know \(temperature\)"):
        R.main(["--resume", str(run_dir)])


@pytest.mark.slow
def test_a_crash_while_saving_the_teacher_then_resume_logs_each_line_once(tmp_path, monkeypatch):
    flags = ["--env", "webshop", "--algo", "skill-grpo"]
    reference, _, _ = run_cli(tmp_path, "reference", *flags)
    run_dir = tmp_path / "crashed"
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "teacher")  # after its reports
    R.main(["--resume", str(run_dir)])

    def logged(folder):
        evals = [(e["phase"], e["iteration"], e["panel"], e["skills"], e["overall"])
                 for e in R.read_jsonl(folder / "eval.jsonl")]
        return evals, [e["event"] for e in R.read_jsonl(folder / "events.jsonl") if e["event"] != "resume"]
    assert logged(run_dir) == logged(reference)  # the reports, teacher_ready, the memory estimate: once each


def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_resume_sets_damaged_checkpoints_aside_and_drops_a_cut_last_log_line(tmp_path, monkeypatch, capsys):
    flags = ["--env", "webshop", "--algo", "grpo", "--iterations", "4", "--keep-checkpoints", "3"]
    reference, _, _ = run_cli(tmp_path, "reference", *flags)
    run_dir = tmp_path / "damaged"
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00003")
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1-student-00000", "1-student-00001", "1-student-00002"]
    cut_in_half(checkpoints / "1-student-00002" / "trainer.pt")  # a crash or a full disk while writing them
    cut_in_half(checkpoints / "1-student-00001" / "model.safetensors")
    shutil.copytree(reference / "checkpoints" / "1-student-00003", checkpoints / "1-student-00003")  # another run's
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(run_dir / name, "a") as f:
            f.write('{"phase": "student", "itera')  # killed in the middle of a line
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])
    out = capsys.readouterr().out
    assert "checkpoint 1-student-00003 is not usable (it belongs to run" in out
    assert "checkpoint 1-student-00002 is not usable (trainer.pt does not load" in out
    assert "checkpoint 1-student-00001 is not usable (model.safetensors is cut short" in out
    assert f"the last line of {run_dir / 'metrics.jsonl'} was cut short" in out
    assert f"the last line of {run_dir / 'events.jsonl'} was cut short" in out
    assert "resuming" in out and "from checkpoint 1-student-00000" in out
    assert {p.name for p in checkpoints.iterdir()} >= {f"1-student-0000{k}.corrupt" for k in (1, 2, 3)}
    # iterations 1-3 were redone from the intact checkpoint: the same run as the uninterrupted one
    assert comparable(R.read_jsonl(run_dir / "metrics.jsonl")) == comparable(R.read_jsonl(reference / "metrics.jsonl"))
    ours = R.load_policy(str(run_dir / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    theirs = R.load_policy(str(reference / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert [e["event"] for e in R.read_jsonl(run_dir / "events.jsonl")].count("done") == 1


def test_read_jsonl_drops_only_a_cut_last_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    line = lambda k: f'{{"phase": "student", "iteration": {k}}}\n'  # noqa: E731
    log.write_text(line(0) + line(1) + '{"itera')
    assert R.read_jsonl(log) == [{"phase": "student", "iteration": k} for k in (0, 1)]
    log.write_text(line(0) + '{"itera\n' + line(2))  # damaged before the last line: not guessed at
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        R.read_jsonl(log)


def test_read_jsonl_skips_lines_that_are_json_but_not_records_of_the_log(tmp_path, capsys):
    # before: a list, a line without its keys, a NaN and JSON nested 200,000 deep ended in tracebacks (or the NaN
    # was written back on a resume); each is now skipped with a note, and a resume rewrites the log without it
    log = tmp_path / "metrics.jsonl"
    good = '{"phase": "student", "iteration": 0}\n'
    log.write_text(good + '[1, 2]\n{"iteration": 1}\n{"phase": "student", "iteration": 2, "loss": NaN}\n'
                   + "[" * 200_000 + "]" * 200_000 + "\n" + good)
    assert R.read_jsonl(log, note=True) == [{"phase": "student", "iteration": 0}] * 2
    assert "line(s) 2, 3, 4, 5 are not records of this log (damaged): skipped" in capsys.readouterr().out
    (tmp_path / "events.jsonl").write_text('{"no_event": 1}\n{"event": "start"}\n')
    assert R.read_jsonl(tmp_path / "events.jsonl") == [{"event": "start"}]
    (tmp_path / "eval.jsonl").write_text('{"panel": "report"}\n')
    assert R.read_jsonl(tmp_path / "eval.jsonl") == []


DAMAGED_VALUES = {  # lines that parse, with keys a record has, holding values no run writes (round 6: tracebacks)
    "metrics.jsonl": ['{"phase": "warmup", "iteration": 1}', '{"phase": "student", "iteration": "1"}',
                      '{"phase": "student", "iteration": true}', '{"phase": "student", "iteration": -3}'],
    "events.jsonl": ['{"event": "retirement", "rule": "adaptive"}', '{"event": "memory_estimate", "phase": "phase 3"}',
                     '{"event": 7}', '{"event": "retirement", "retired_at": "soon", "decided_after_iteration": 1}'],
    "eval.jsonl": ['{"phase": "student", "iteration": 0, "panel": "report", "skills": "no", "overall": 0.5}',
                   '{"phase": "student", "iteration": 0, "panel": "validation", "skills": false, "overall": "half"}',
                   '{"phase": "student", "iteration": 0.5, "panel": "validation", "skills": false, "overall": 0.5}',
                   '{"phase": "student", "iteration": 0, "panel": "final", "skills": false, "overall": 0.5}'],
}


def test_a_log_line_with_values_no_run_writes_is_skipped_with_a_note_and_the_resume_goes_on(stopped_runs, tmp_path,
                                                                                             capsys):
    # a record is judged by its values, not only its keys: each damaged line is skipped (a hole, where it was an
    # iteration's), the resume rewrites the log without it, and nothing ends in a traceback
    run_dir = stopped_copy(stopped_runs, tmp_path, "retireopd")
    for name, lines in DAMAGED_VALUES.items():
        with open(run_dir / name, "a", encoding="utf-8") as log:
            log.write("".join(line + "\n" for line in lines))
        assert len(R.read_jsonl(run_dir / name)) == len((run_dir / name).read_text().splitlines()) - len(lines)
    R.main(["--resume", str(run_dir)])
    out = capsys.readouterr().out
    for name in DAMAGED_VALUES:
        assert f"{run_dir / name} line(s)" in out and "are not records of this log (damaged): skipped" in out, name
        assert not any(line in (run_dir / name).read_text() for line in DAMAGED_VALUES[name])  # rewritten without
    assert R.read_jsonl(run_dir / "events.jsonl")[-1]["event"] == "done"


def test_saved_model_problem_finds_a_half_written_safetensors_file(tiny, tmp_path):
    model, tok = tiny
    folder = R.Run(small_cfg(run_dir=str(tmp_path))).save_model(model, tok, "student")
    assert model_sources.saved_model_problem(folder) is None
    cut_in_half(folder / "model.safetensors")
    assert "model.safetensors is cut short" in model_sources.saved_model_problem(folder)
    with open(folder / "model.safetensors", "r+b") as f:  # cut inside its header
        f.truncate(20)
    assert "header is incomplete" in model_sources.saved_model_problem(folder)


def test_unwritable_run_folders_are_one_line_errors_before_anything_runs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for run_dir, message in ((a_file, f"{a_file} is a file, not a folder"),
                             (a_file / "run", f"{a_file} is a file, not a folder"),
                             (Path("/proc/retireopd-run"), "cannot create or write a folder there")):
        with pytest.raises(SystemExit) as failure:
            R.main(QUICK + ["--env", "webshop", "--run-dir", str(run_dir)])
        assert str(failure.value.code).startswith(f"retireopd: --run-dir {run_dir}: {message}")
        assert "\n" not in str(failure.value.code)


def private_tmpfs_command(tmp_path, options, command):
    """`command` run with a fresh tmpfs (mount `options`) on tmp_path/mnt, in a private mount
    namespace (nothing outlives the process), or None where this machine does not allow one."""
    import subprocess
    mount = tmp_path / "mnt"
    mount.mkdir(exist_ok=True)
    wrapper = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o "$0" none "$1" && shift && exec "$@"', options,
               str(mount)]
    if shutil.which("unshare") is None or subprocess.run([*wrapper, "true"], capture_output=True).returncode != 0:
        return None
    return [*wrapper, *command]


@pytest.mark.slow
def test_the_rotation_never_deletes_what_is_mounted_inside_an_old_checkpoint(tmp_path, monkeypatch):
    # another user's folder bind-mounted at the oldest checkpoint's name (round 6: the rotation deleted its files):
    # the resumed run's rotation keeps that checkpoint, with a note, and the folder's files are untouched
    run_dir = tmp_path / "run"
    crash_instead_of_saving(monkeypatch, run_dir, ["--env", "webshop", "--algo", "grpo"],
                            lambda name: name.endswith("-00002"))
    run_folder.release_run_folders()  # (the crash above left this process holding the folder)
    oldest = checkpoint_folders(run_dir)[0]
    victim, contents = victim_of(tmp_path)
    before = contents()
    command = ["unshare", "-rm", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(victim), str(oldest),
               sys.executable, "retireopd.py", "--resume", str(run_dir)]
    if shutil.which("unshare") is None or subprocess.run([*command[:4], "true"], capture_output=True).returncode:
        pytest.skip("no private mount namespace here (unshare -rm)")
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"the old checkpoint {oldest.name} is kept" in done.stdout + done.stderr
    assert contents() == before
    assert (run_dir / "student" / "config.json").is_file()


@pytest.mark.slow
def test_a_link_in_the_tensorboard_folder_is_refused_and_the_tracker_writes_in_a_folder_made_anew(tmp_path,
                                                                                                  monkeypatch):
    # round 6: on `--resume --report-to tensorboard` a link planted at the predictable event-file name was
    # followed, and another user's file overwritten
    pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt; without it this test cannot run")
    import socket
    import dashboards
    run_dir = tmp_path / "run"
    crash_instead_of_saving(monkeypatch, run_dir, ["--env", "webshop", "--report-to", "tensorboard"],
                            lambda name: name == "checkpoints/1-student-00001")
    victim, contents = victim_of(tmp_path)
    before = contents()
    planted = run_dir / "tensorboard" / f"events.out.tfevents.{int(time.time()) + 5:010d}.{socket.gethostname()}." \
                                        f"{os.getpid()}.1"  # (the name a writer started five seconds from now takes)
    planted.symlink_to(victim / "notes.txt")
    one_line_refusal(["--resume", str(run_dir)], f"{planted} is a link to .*: a run folder's own entries must be plain")
    planted.unlink()
    real_make_fresh = dashboards.make_fresh

    def plant_then_make_fresh(folder, root):  # planted after the start's check, before the tracker starts
        planted.symlink_to(victim / "notes.txt")
        return real_make_fresh(folder, root)
    with monkeypatch.context() as patch:
        patch.setattr(dashboards, "make_fresh", plant_then_make_fresh)
        one_line_refusal(["--resume", str(run_dir)], f"{planted} is a link, inside the run's tensorboard/")
    planted.unlink()
    assert contents() == before
    old_umask = os.umask(0o000)  # (a umask that would let anyone add to a folder it makes)
    try:
        R.main(["--resume", str(run_dir)])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.lstat(run_dir / "tensorboard").st_mode) == 0o755  # no one else can add a name to it
    assert len(list((run_dir / "tensorboard").iterdir())) == 2 and contents() == before


@pytest.mark.slow
def test_a_read_only_disk_is_a_one_line_error(tmp_path):
    import subprocess
    run_dir = tmp_path / "mnt" / "run"
    command = private_tmpfs_command(tmp_path, "ro,size=1m", [sys.executable, "retireopd.py", *QUICK, "--env",
                                                             "webshop", "--run-dir", str(run_dir)])
    if command is None:  # (as root, chmod does not stop writes: a read-only mount is the real thing)
        pytest.skip("no private mount namespace here (unshare -rm) for a real read-only filesystem")
    done = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"retireopd: --run-dir {run_dir}: cannot create or write a folder there (Read-only file system): "
        "choose one on a writable disk")


FULL_DISK_DRIVER = """
import json, os, resource, signal, sys
from pathlib import Path
import model_sources
import retireopd as R
from common import checkpoint_folders
run_dir, how, summary, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
ballast, soft_limit = run_dir.parent / "ballast", resource.getrlimit(resource.RLIMIT_FSIZE)
real_checkpoint, filled = R.Run.checkpoint, []

def checkpoint(self, *args, **kwargs):  # after the first checkpoint, the disk fills up (once)
    real_checkpoint(self, *args, **kwargs)
    if filled:
        return
    filled.append(how)
    if how == "fsize":  # files stop growing at 512 KiB: the write fails as on a full disk (EFBIG, not ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, soft_limit[1]))
        return
    # room for the log lines and the next checkpoint's weights, not for its trainer.pt: torch.save fails
    # ("unexpected pos", as reported), after safetensors succeeded
    newest = checkpoint_folders(self.dir)[-1]
    room = sum(f.stat().st_size for f in newest.iterdir() if f.name != "trainer.pt") + 256 * 1024
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:  # full
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - room))
    os.close(fd)

R.Run.checkpoint = checkpoint
try:
    R.main(flags + ["--run-dir", str(run_dir)])
    message = None
except SystemExit as stop:
    message = str(stop.code)
left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
kept_whole = all(model_sources.saved_model_problem(run_dir / "checkpoints" / name) is None for name in left)
ballast.unlink(missing_ok=True)  # make room again, then resume
resource.setrlimit(resource.RLIMIT_FSIZE, soft_limit)
R.main(["--resume", str(run_dir)])
metrics = [(m["phase"], m["iteration"]) for m in R.read_jsonl(run_dir / "metrics.jsonl")]
Path(summary).write_text(json.dumps({"message": message, "left": left, "kept_whole": kept_whole, "metrics": metrics}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "fsize"])
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_what_to_do(tmp_path, how):
    import subprocess
    flags = QUICK + ["--env", "webshop", "--algo", "grpo"]
    summary = tmp_path / "summary.json"
    driver = [sys.executable, "-c", FULL_DISK_DRIVER]
    run_dir = tmp_path / "mnt" / "run"
    if how == "tmpfs":  # a real full disk: a small tmpfs filled up after the first checkpoint
        command = private_tmpfs_command(tmp_path, "size=64m", driver)
        if command is None:
            pytest.skip("no private mount namespace here (unshare -rm) for a small filesystem to fill")
    else:
        command = driver
    done = subprocess.run([*command, str(run_dir), how, str(summary), json.dumps(flags)], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-8000:]
    result = json.loads(summary.read_text())
    message = result["message"]
    assert message.startswith(f"retireopd: could not write {run_dir / 'checkpoints' / '1-student-00001'} (")
    assert ("the disk is full: " in message) == (how == "tmpfs")  # (fsize: "File too large", the disk has room)
    assert f"the last checkpoint, 1-student-00000, is kept: `--resume {run_dir}` continues from it" in message
    assert "\n" not in message and (("--keep-checkpoints" in message and "--save-every" in message) if how == "tmpfs"
                                    else "ulimit -f" in message and "free some space" not in message)
    assert result["left"] == ["1-student-00000"] and result["kept_whole"]  # no half-written one left
    assert result["metrics"] == [["student", k] for k in range(3)]  # resumed, nothing twice


@pytest.mark.slow
@pytest.mark.parametrize("second_ctrl_c", [False, True])
def test_ctrl_c_names_the_run_folder_to_resume(tmp_path, second_ctrl_c):
    import signal
    import subprocess
    import time as time_module
    run_dir = tmp_path / "my run"  # a space: the command must still be one to copy
    process = subprocess.Popen([sys.executable, "retireopd.py", *QUICK, "--env", "webshop", "--algo", "grpo",
                                "--iterations", "50", "--run-dir", str(run_dir)], cwd=Path(__file__).parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               # Ctrl-C reaches the run even when these tests run as a background job, which
                               # a shell starts with SIGINT ignored (the run would inherit that)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time_module.time() + 120
    while time_module.time() < deadline and process.poll() is None and not R.read_jsonl(run_dir / "metrics.jsonl"):
        time_module.sleep(0.05)
    process.send_signal(signal.SIGINT)
    while second_ctrl_c and process.poll() is None:  # Ctrl-C again and again while the run unwinds (a second
        try:                                          # sent at once would be folded into the first)
            process.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
        time_module.sleep(0.002)
    _, stderr = process.communicate(timeout=120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert process.returncode == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"[retireopd] interrupted: continue with `python retireopd.py "
                                               f"--resume '{run_dir}'` (from the last checkpoint)")


def test_truncate_logs_drops_every_log_line_after_the_checkpoint(tmp_path):
    run = R.Run(small_cfg(run_dir=str(tmp_path)))
    for phase in ("teacher", "student"):
        for k in range(3):
            run.log("metrics.jsonl", {"phase": phase, "iteration": k})
            run.log("eval.jsonl", {"phase": phase, "iteration": k, "panel": "validation", "skills": False,
                                   "overall": 0.5})
    for k in (0, 2):
        run.log("events.jsonl", {"event": "retirement", "retired_at": k + 1, "decided_after_iteration": k})
    repairs.truncate_logs(tmp_path, "student", 1, finished=(), last_iterations={"teacher": 2, "student": 2})
    kept = [("teacher", 0), ("teacher", 1), ("teacher", 2), ("student", 0), ("student", 1)]
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert [(r["phase"], r["iteration"]) for r in R.read_jsonl(tmp_path / name)] == kept, name
    assert [e["decided_after_iteration"] for e in R.read_jsonl(tmp_path / "events.jsonl")] == [0]


@pytest.mark.slow
def test_a_resume_into_phase_two_holds_no_trainer_state_of_phase_one(tmp_path, monkeypatch):
    # Interrupted after the teacher is saved, before the student's first checkpoint (as after an
    # S_T = 0 stop): the resume starts from phase 1's last checkpoint, whose trainer state carries
    # AdamW's moments (12 GB at 1.5B). Phase 2 must not keep them alive.
    class Interrupted(Exception):
        pass

    def interrupted(*args, **kwargs):
        raise Interrupted

    real = R.train_student
    monkeypatch.setattr(R, "train_student", interrupted)
    with pytest.raises(Interrupted):
        run_cli(tmp_path, "run", "--env", "webshop", "--iterations", "2")
    held = []

    real_phase = R.train_phase

    def counting(phase, *args, **kwargs):
        gc.collect()
        held.extend(o for o in gc.get_objects() if type(o) is dict and {"optimizer", "python_rng"} <= set(o))
        return real_phase(phase, *args, **kwargs)

    monkeypatch.setattr(R, "train_student", real)
    monkeypatch.setattr(R, "train_phase", counting)
    R.main(["--resume", str(tmp_path / "run")])
    assert held == [] and (tmp_path / "run" / "student" / "retireopd.json").is_file()


HERE = Path(__file__).parent


GRPO = ["--env", "webshop", "--algo", "grpo"]


def interrupted_run(tmp_path, monkeypatch, name, *flags):
    """A webshop run that dies where the student's final model would be saved: its checkpoints stay."""
    run_dir = tmp_path / name
    crash_instead_of_saving(monkeypatch, run_dir, [*GRPO, *flags], lambda saved: saved == "student")
    return run_dir


# --- no pickle from a run folder; one process per folder; a resume reads what the run read -----------


class RunsCode:
    """Unpickled, this runs a shell command (what a hostile trainer.pt would hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_trainer_pt_that_would_run_code_is_set_aside_and_nothing_of_it_runs(tmp_path, monkeypatch, capsys):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    state = torch.load(newest / "trainer.pt", weights_only=True)
    marker = tmp_path / "the-command-ran"
    torch.save({**state, "extra": RunsCode(marker)}, newest / "trainer.pt")
    R.main(["--resume", str(run_dir)])
    assert not marker.exists()  # weights_only=False (before) ran it, and resumed as if nothing happened
    assert (newest.parent / (newest.name + ".corrupt")).is_dir()
    assert "asks to build objects that are not data" in capsys.readouterr().out
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


@pytest.mark.parametrize("damage", ["a tensor missing", "a NaN"])
def test_a_checkpoint_lacking_a_tensor_or_holding_a_nan_is_set_aside_and_the_one_before_used(
        tmp_path, monkeypatch, capsys, damage):
    from safetensors.torch import load_file, save_file
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    weights = load_file(newest / "model.safetensors")
    if damage == "a tensor missing":  # before: resumed with that tensor initialised at random
        weights.pop("model.layers.0.self_attn.k_proj.weight")
    else:  # before: refused at every --resume, never set aside
        weights["model.norm.weight"][0] = float("nan")
    save_file(weights, newest / "model.safetensors", metadata={"format": "pt"})
    R.main(["--resume", str(run_dir)])
    assert newest.with_name(newest.name + ".corrupt").is_dir()
    assert ("its weights lack model.layers.0.self_attn.k_proj.weight" if damage == "a tensor missing" else
            "its weight model.norm.weight holds NaN or infinite values") in capsys.readouterr().out
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(iterations="3"), "iterations is '3', not int"),  # before: a TypeError traceback
    (lambda c: c.pop("env"), "it lacks env"),  # before: blamed on the data folder
    (lambda c: c.update(gradient_checkpointing=1), "gradient_checkpointing is 1, not bool"),
    (lambda c: c.update(lr=True), "lr is True, not float")])
def test_a_config_json_with_a_value_of_another_type_or_without_its_env_is_one_line(tmp_path, monkeypatch, edit,
                                                                                     message):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    config = json.loads((run_dir / "config.json").read_text())
    edit(config)
    (run_dir / "config.json").write_text(json.dumps(config))
    one_line_refusal(["--resume", str(run_dir)], f"its config.json is damaged \\({message}\\)")


def test_a_resume_continues_the_same_run_or_says_why_not(tmp_path, monkeypatch):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r", "--algo", "grpo+opd")
    config_text = (run_dir / "config.json").read_text()
    # config.json's algo edited: before, the next iteration trained as pure OPD while run.json said grpo+opd
    (run_dir / "config.json").write_text(json.dumps({**json.loads(config_text), "algo": "opd"}))
    one_line_refusal(["--resume", str(run_dir)], "its config.json says algo opd \\(the run's is grpo\\+opd\\)")
    (run_dir / "config.json").write_text(config_text)
    # another run's teacher/ put back in place of a lost one: before, accepted
    other = interrupted_run(tmp_path, monkeypatch, "other", "--algo", "grpo+opd")
    shutil.rmtree(run_dir / "teacher")
    shutil.copytree(other / "teacher", run_dir / "teacher")
    logs = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "eval.jsonl", "events.jsonl")}
    one_line_refusal(["--resume", str(run_dir)], "teacher was written by run .+, and this folder holds run")
    # refused before the resume trims anything: the logs are as they were (the student's report line too)
    assert {name: (run_dir / name).read_bytes() for name in logs} == logs


def test_a_run_inside_another_runs_checkpoints_is_never_taken_for_a_checkpoint(tmp_path, monkeypatch):
    outer = interrupted_run(tmp_path, monkeypatch, "outer")
    inner = outer / "checkpoints" / "my-run"
    R.main(QUICK + [*GRPO, "--run-dir", str(inner)])  # before: the outer resume renamed it my-run.corrupt
    lookalike = outer / "checkpoints" / "1-student-00099"  # a run folder named like a checkpoint
    shutil.copytree(inner, lookalike)
    R.main(["--resume", str(outer)])
    assert (inner / "run.json").is_file() and (lookalike / "run.json").is_file()
    assert not list((outer / "checkpoints").glob("*.corrupt"))


def test_a_resume_refuses_a_model_folder_whose_weights_changed(tmp_path, monkeypatch):
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=0)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    run_dir = interrupted_run(tmp_path, monkeypatch, "r", "--model", str(base))
    R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=1)[0].save_pretrained(base)  # other weights
    one_line_refusal(["--resume", str(run_dir)], "would not train on what the run started with \\(model_weights ")


def test_a_trainer_state_must_hold_what_a_checkpoint_writes():
    whole = {key: 0 for key in repairs.TRAINER_STATE_KEYS} | {"phase": "student", "optimizer": {}, "val_successes": []}
    assert repairs.trainer_state_problem(whole) is None
    assert "lacks run_id" in repairs.trainer_state_problem({k: v for k, v in whole.items() if k != "run_id"})
    assert "names no iteration" in repairs.trainer_state_problem({**whole, "phase": "x"})
    assert "holds a list" in repairs.trainer_state_problem([1, 2])


@pytest.mark.slow
def test_two_starts_at_once_and_a_resume_of_a_live_run_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "shared"
    command = [sys.executable, "retireopd.py", *QUICK, *GRPO, "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a busy machine: the starts interleave
    try:
        starts = [subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True) for _ in range(2)]
        errors = [start.communicate(timeout=300)[1] for start in starts]
    finally:
        load.kill()
    assert sorted(start.returncode for start in starts) == [0, 1]  # before: 0 and 0, every line twice
    refused = errors[[start.returncode for start in starts].index(1)].strip().splitlines()[-1]
    assert refused.startswith(f"retireopd: {run_dir} is in use by process ") and "--resume" in refused
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert len({m["run_id"] for m in R.read_jsonl(run_dir / "events.jsonl") if "run_id" in m}) <= 1

    live = tmp_path / "live"  # a run that is still going: its --resume is refused, and names it
    process = subprocess.Popen([*command[:-1], str(live), "--iterations", "200"], cwd=HERE, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not R.read_jsonl(live / "metrics.jsonl"):
            time.sleep(0.05)
        one_line_refusal(["--resume", str(live)], f"is in use by process {process.pid} on ")
    finally:
        process.kill()
        process.wait()


def write_catalogue(folder, products):
    folder.mkdir(exist_ok=True)
    _, attributes = webshop_env.builtin_catalogue()
    (folder / webshop_env.PRODUCTS_FILE).write_text(json.dumps(products))
    (folder / webshop_env.ATTRIBUTES_FILE).write_text(json.dumps(attributes))


def test_a_resume_reads_the_data_the_run_started_with_and_refuses_other_data(tmp_path, monkeypatch, capsys):
    products, _ = webshop_env.builtin_catalogue()
    data = tmp_path / "shop"
    write_catalogue(data, products[:9])  # not the built-in catalogue: fewer goals
    tasks = len(webshop_env.WebShop(str(data)).train_goal_indices)
    assert tasks != len(webshop_env.WebShop("builtin").train_goal_indices)
    monkeypatch.setenv("WEBSHOP_DATA", str(data))
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    assert json.loads((run_dir / "config.json").read_text())["webshop_data"] == str(data)  # before: null
    monkeypatch.delenv("WEBSHOP_DATA")
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])  # before: the built-in catalogue's 26 tasks, without a word
    assert f"({tasks} training tasks" in capsys.readouterr().out
    other = interrupted_run(tmp_path, monkeypatch, "other", "--webshop-data", str(data))
    write_catalogue(data, products[:10])  # the folder's files changed under the run
    one_line_refusal(["--resume", str(other)], "would not train on what the run started with \\(train_tasks")


@pytest.mark.parametrize("damage", ["removed", "cut"])
def test_a_lost_run_json_is_restored_from_the_checkpoints(tmp_path, monkeypatch, capsys, damage):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if damage == "removed":
        (run_dir / "run.json").unlink()
    else:
        (run_dir / "run.json").write_text('{"run_id": "2026')
        (run_dir / "run.json.corrupt").mkdir()  # an older one set aside, in the way: before, IsADirectoryError
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])
    said = capsys.readouterr().out
    assert f"restored from checkpoint {kept[-1]} (run {run_id})" in said and "set aside" not in said
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_id
    assert (run_dir / "run.json.corrupt").exists() == (damage == "cut")
    resumed = [e for e in R.read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed[-1]["checkpoint"] == kept[-1]  # before: every checkpoint set aside, phase 2 from 0
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


# --- numbers: no NaN trained on or saved -------------------------------------------------------------


def test_a_step_that_leaves_non_finite_weights_stops_the_run_and_nothing_of_it_is_saved(tmp_path, monkeypatch):
    real_build = R.build_adamw

    def build_diverging_adamw(model, cfg):  # the second optimizer step leaves a NaN in the weights
        optimizer = real_build(model, cfg)
        real_step = optimizer.step

        def step(*args, **kwargs):
            out = real_step(*args, **kwargs)
            if R.optimizer_steps_taken(optimizer) == 2:
                next(model.parameters()).data[0, 0] = float("nan")
            return out
        optimizer.step = step
        return optimizer
    monkeypatch.setattr(R, "build_adamw", build_diverging_adamw)
    run_dir = tmp_path / "r"
    one_line_refusal(QUICK + GRPO + ["--run-dir", str(run_dir)],
                     "optimizer step 2 \\(lr 0.0001\\) left the weights with NaN or infinite values")
    for checkpoint in (run_dir / "checkpoints").iterdir():  # the one before the step, finite
        assert R.non_finite_tensors(R.load_policy(str(checkpoint), torch.device("cpu"), torch.float32)[0]
                                    .parameters()) == 0
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", 0)]


def test_a_non_finite_model_is_neither_loaded_nor_saved_and_logs_hold_no_nan(tmp_path):
    cfg = R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")})
    run = R.Run(cfg)
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    run.save_model(model, tok, "finite")
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(SystemExit, match="not saving .*broken: [12] of its tensors hold NaN or infinite values"):
        run.save_model(model, tok, "broken")
    assert not (run.dir / "broken").exists() and not (run.dir / "broken.tmp").exists()
    model.save_pretrained(tmp_path / "nan-model")  # written by someone else
    tok.save_pretrained(tmp_path / "nan-model")
    with pytest.raises(SystemExit, match="weight tensors hold NaN or infinite values: not a usable model"):
        R.load_policy(str(tmp_path / "nan-model"), torch.device("cpu"), torch.float32)
    run.log("metrics.jsonl", {"loss": float("nan"), "terms": [1.0, float("-inf")]})
    assert json.loads((run.dir / "metrics.jsonl").read_text(), parse_constant=pytest.fail) == {
        "loss": None, "terms": [1.0, None]}


def test_iterations_whose_every_step_is_skipped_are_said_and_three_in_a_row_stop(capsys):
    skipped = {"phase": "student", "optimizer_steps": 0, "skipped_steps": 2}
    streak = repairs.note_skipped_steps({**skipped, "iteration": 0}, 0)
    assert streak == 1 and "student iteration 0: all 2 optimizer steps were skipped" in capsys.readouterr().out
    streak = repairs.note_skipped_steps({**skipped, "iteration": 1, "optimizer_steps": 1}, streak)  # a step taken
    assert streak == 0  # the count restarts
    streak = repairs.note_skipped_steps({**skipped, "iteration": 2}, streak)
    streak = repairs.note_skipped_steps({**skipped, "iteration": 3}, streak)
    with pytest.raises(SystemExit, match="3 iterations in a row \\(up to student iteration 4\\)"):
        repairs.note_skipped_steps({**skipped, "iteration": 4}, streak)


# --- a broken game; the teacher; signals; the remaining tracebacks -----------------------------------


def test_a_game_whose_reset_fails_is_counted_never_trained_on_and_a_broken_panel_stops(tmp_path, monkeypatch):
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path / "run"), "max_turns": 2,
                          "max_response_tokens": 4})
    suite = R.TaskSuite(cfg)
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    real_reset = kitchen_env.KitchenEnv.reset
    broken = {task for task in suite.validation_panel[:12] if task % 2}

    def reset(self):  # what AlfWorldEnv.reset returns for a game file it cannot load
        observation, info = real_reset(self)
        return ("", {**info, "task": "", "error": "ValueError: broken game"}) if self.task in broken else (
            observation, info)
    monkeypatch.setattr(kitchen_env.KitchenEnv, "reset", reset)
    result = R.evaluate(model, tok, suite, suite.validation_panel[:12], cfg, skills_in_prompt=False, desc="validation")
    assert result["env_errors"] == len(broken) and result["n"] == 12 - len(broken)  # before: 0 errors, n 12
    samples, episodes, _ = R.rollout(model, tok, suite, sorted(broken)[:2], cfg, group_size=2,
                                     skills_in_prompt=False, with_teacher_prompts=False, temperature=1.0,
                                     desc="rollout")
    assert samples == [] and all(e.error == "reset: ValueError: broken game" for e in episodes)
    with pytest.raises(SystemExit, match="every episode of the validation \\(6 tasks\\) failed to start, the first "
                                         "with reset: ValueError: broken game: the data is broken"):
        R.evaluate(model, tok, suite, sorted(broken), cfg, skills_in_prompt=False, desc="validation")


def test_a_training_split_whose_every_game_fails_at_reset_is_one_line(tmp_path, monkeypatch):
    real_reset = kitchen_env.KitchenEnv.reset
    monkeypatch.setattr(kitchen_env.KitchenEnv, "reset", lambda self: (  # (what AlfWorldEnv returns for a bad game)
        "", {**real_reset(self)[1], "task": "", "error": "ValueError: broken game"}) if self.task % 1000 < 100
        else real_reset(self))  # (training variants 0-99; the panels' are whole)
    # before: RuntimeError: no turn-samples were produced, a traceback
    one_line_refusal(QUICK + [*GRPO, "--env", "kitchen", "--run-dir", str(tmp_path / "r")],
                     "every episode of an iteration \\(1 tasks x 2\\) failed to start: the training split is broken")


def test_a_teacher_with_another_vocabulary_is_refused_and_the_corrected_command_takes_the_folder(tmp_path, capsys):
    teacher = save_teacher(tmp_path / "big", vocab_extra=64)
    run_dir = tmp_path / "r"
    vocab = R.load_policy("tiny", torch.device("cpu"), torch.float32)[0].config.vocab_size
    one_line_refusal(QUICK + ["--env", "webshop", "--algo", "opd", "--teacher", str(teacher),
                              "--run-dir", str(run_dir)],
                     f"has a vocabulary of {vocab + 64} tokens, the student {vocab}: a teacher must be trained")
    assert (run_dir / "run.json").is_file()  # the start failed after the run folder was written
    capsys.readouterr()
    R.main(QUICK + [*GRPO, "--run-dir", str(run_dir)])  # the corrected command: before, "holds a run"
    assert "stopped before its first iteration (nothing trained or saved): cleared" in capsys.readouterr().out
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert [e["event"] for e in R.read_jsonl(run_dir / "events.jsonl")].count("start") <= 1


def test_a_folder_with_the_names_a_run_writes_is_refused_and_clearing_removes_only_what_the_run_wrote(
        tmp_path, capsys):
    """A user's own wandb/, tensorboard/, plot.png or tiny_base/ (the project's own, with --run-dir .) are never
    written over, added to or removed: a start there is refused in one line that names them. A start that
    stopped before its first iteration is cleared of what it wrote (its run.json says it started clean);
    an older version's run.json keeps its artefacts, whose they are cannot be told, and names them."""
    run_dir = tmp_path / "r"
    theirs = {"wandb/run-1/files.txt": "a wandb run", "tensorboard/events.out": "curves", "plot.png": "a picture",
              "tiny_base/notes.txt": "the user's own base"}
    for name, text in theirs.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    (run_dir / "README.md").write_text("their notes")
    one_line_refusal(QUICK + [*GRPO, "--run-dir", str(run_dir)], "holds no run but holds plot.png, tensorboard, "
                     "tiny_base, wandb, which a run would write over, add to or remove")
    assert sorted(p.name for p in run_dir.iterdir()) == ["README.md", "plot.png", "tensorboard", "tiny_base", "wandb"]
    for name, text in theirs.items():
        assert (run_dir / name).read_text() == text, name
    # a demo base this script wrote, put there beforehand (as study.py does), is used and never removed
    based = tmp_path / "based"
    shutil.copytree(R.SHIPPED_BASE, based / "tiny_base")
    teacher = save_teacher(tmp_path / "big", vocab_extra=64)
    one_line_refusal(QUICK + ["--env", "webshop", "--algo", "opd", "--teacher", str(teacher), "--run-dir", str(based)],
                     "a teacher must be trained")
    assert json.loads((based / "run.json").read_text())["found_at_start"] == ["tiny_base"]
    R.main(QUICK + [*GRPO, "--run-dir", str(based)])
    assert (based / "tiny_base" / "retireopd.json").is_file()
    # a start that fails after run.json is written, in a folder that holds only the user's README: cleared
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "README.md").write_text("their notes")
    one_line_refusal(QUICK + ["--env", "webshop", "--algo", "opd", "--teacher", str(teacher), "--run-dir", str(clean)],
                     "a teacher must be trained")
    assert json.loads((clean / "run.json").read_text())["clean_start"] is True
    (clean / "tensorboard").mkdir()  # (as if its tracker had started)
    capsys.readouterr()
    R.main(QUICK + [*GRPO, "--run-dir", str(clean)])
    assert "cleared (removed what it wrote: run.json, config.json, tensorboard)" in capsys.readouterr().out
    assert (clean / "README.md").read_text() == "their notes" and not (clean / "tensorboard").exists()
    # an older version's run.json (no clean_start): its logs cleared, the artefacts kept and named
    old = tmp_path / "old"
    one_line_refusal(QUICK + ["--env", "webshop", "--algo", "opd", "--teacher", str(teacher), "--run-dir", str(old)],
                     "a teacher must be trained")
    identity = json.loads((old / "run.json").read_text())
    del identity["clean_start"]
    (old / "run.json").write_text(json.dumps(identity))
    (old / "wandb").mkdir()
    (old / "wandb" / "theirs.txt").write_text("kept")
    one_line_refusal(QUICK + [*GRPO, "--run-dir", str(old)], "holds no run but holds wandb")
    assert (old / "wandb" / "theirs.txt").read_text() == "kept" and not (old / "run.json").exists()


def test_a_model_loads_whole_or_not_at_all(tmp_path, capsys):
    """Weights that lack a tensor, hold another architecture's, or another shape's: refused in one line for a
    --model folder and a teacher, set aside for a checkpoint (transformers would initialise them at random)."""
    from safetensors.torch import load_file, save_file
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)

    def saved(name, edit):
        folder = tmp_path / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        weights = load_file(folder / "model.safetensors")
        edit(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return folder

    lacking = saved("lacking", lambda w: w.pop("model.layers.1.self_attn.q_proj.weight"))
    assert "its weights lack model.layers.1.self_attn.q_proj.weight" in model_sources.saved_model_problem(lacking)
    extra = saved("extra", lambda w: w.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2, 2)}))
    assert "hold tensors this model does not have: model.layers.2.mlp.up_proj.weight" in \
        model_sources.saved_model_problem(extra)
    wrong = saved("wrong", lambda w: w.update({"model.norm.weight": torch.ones(3)}))
    assert "of another shape than its config.json's: model.norm.weight" in model_sources.saved_model_problem(wrong)
    config = json.loads((saved("other", lambda w: None) / "config.json").read_text())  # another architecture
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3,
                                                                "layer_types": ["full_attention"] * 3}))
    assert "its weights lack model.layers.2." in model_sources.saved_model_problem(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))  # (invalid)
    assert "its config.json does not describe a causal language model" in model_sources.saved_model_problem(
        tmp_path / "other")
    one_line_refusal(QUICK + [*GRPO, "--model", str(lacking), "--run-dir", str(tmp_path / "r")],
                     "its weights lack model.layers.1.self_attn.q_proj.weight")
    with pytest.raises(SystemExit, match="not the whole model its config.json describes"):  # (the load's own check)
        R.load_policy(str(lacking), torch.device("cpu"), torch.float32)
    assert R.load_policy(str(saved("whole", lambda w: None)), torch.device("cpu"), torch.float32)[0] is not None


def test_a_failed_start_before_the_run_leaves_no_folder(tmp_path):
    one_line_refusal(QUICK + ["--env", "webshop", "--webshop-data", str(tmp_path), "--run-dir",
                              str(tmp_path / "a" / "b")], "items_shuffle_1000.json")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("stored,said", [
    (float("nan"), "is nan"), (7.0, "is 7.0, not a number in \\[0, 1\\]"), (-0.25, "is -0.25"), ("0.8", "is '0.8'"),
    ([0.5], "is \\[0.5\\]"), (True, "is True"), (None, None)])
def test_a_bad_stored_S_T_is_a_damaged_teacher_in_one_line(tmp_path, stored, said):
    record = {} if stored is None else {"teacher_success": stored}
    teacher = save_teacher(tmp_path / "t")
    (teacher / "retireopd.json").write_text(json.dumps({"env": "webshop", **record}))
    one_line_refusal(QUICK + ["--env", "webshop", "--teacher", str(teacher), "--run-dir", str(tmp_path / "r")],
                     "retireopd.json is damaged: " + ("it holds no teacher_success" if said is None else
                                                      "its teacher_success \\(S_T\\) " + said))
    assert not (tmp_path / "r").exists()  # before: NaN and 7.0 never retired, the rest a traceback


def test_a_cut_retireopd_json_is_reported_as_damaged_not_missing(tmp_path):
    teacher = save_teacher(tmp_path / "t")
    (teacher / "retireopd.json").write_text('{"teacher_succ')
    assert "retireopd.json is damaged (JSONDecodeError)" in model_sources.teacher_folder_problem(teacher, "webshop")
    (teacher / "model.safetensors").unlink()  # a teacher folder that is not a model
    (teacher / "retireopd.json").write_text(json.dumps({"teacher_success": 0.5, "env": "webshop"}))
    assert "is not a whole model folder (no .safetensors weights)" in model_sources.teacher_folder_problem(
        teacher, "webshop")


@pytest.mark.slow
def test_sigterm_stops_after_the_iteration_with_a_checkpoint_and_the_resume_line(tmp_path):
    run_dir = tmp_path / "r"
    process = subprocess.Popen([sys.executable, "retireopd.py", *QUICK, *GRPO, "--iterations", "40", "--save-every",
                                "0", "--run-dir", str(run_dir)], cwd=HERE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and not R.read_jsonl(run_dir / "metrics.jsonl"):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM  # before: 143 too, but no message and no checkpoint
    last = R.read_jsonl(run_dir / "metrics.jsonl")[-1]["iteration"]
    assert stderr.strip().splitlines()[-1] == (
        f"[retireopd] stopped by SIGTERM after student iteration {last}, with a checkpoint: continue with "
        f"`python retireopd.py --resume {run_dir}` (from the last checkpoint)")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"1-student-{last:05d}"]  # --save-every 0
    R.main(["--resume", str(run_dir)])
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(40)]


def test_the_remaining_tracebacks_are_one_line(tmp_path, monkeypatch):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "newer_setting": 1}))
    one_line_refusal(["--resume", str(run_dir)], "does not know \\(newer_setting\\): it was written by another")
    one_line_refusal(QUICK + [*GRPO, "--run-dir", str(tmp_path / ("n" * 300))], "longer than the filesystem allows")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    one_line_refusal(QUICK + [*GRPO, "--model", str(tmp_path / "weightless"), "--run-dir", str(tmp_path / "w")],
                     "has no .safetensors weights")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    one_line_refusal(["--compare", str(run_dir), str(tmp_path / "half")], "no metrics.jsonl in")
    (tmp_path / "half" / "metrics.jsonl").write_text('{"x": 1}\n')
    one_line_refusal(["--compare", str(run_dir), str(tmp_path / "half")], "cannot draw .* not a run's of this script")
    shop = tmp_path / "shop"
    write_catalogue(shop, [{"asin": "B0"}])  # a product without its fields
    one_line_refusal(QUICK + [*GRPO, "--webshop-data", str(shop), "--run-dir", str(tmp_path / "s")],
                     "the webshop data in .* is malformed \\(KeyError")
    assert not (tmp_path / "s").exists()


def test_advice_fits_the_failure(tmp_path):
    import errno
    run = R.Run(R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")}))
    too_big = repairs.write_failure(run.dir, "metrics.jsonl", OSError(errno.EFBIG, "File too large"))
    assert "ulimit -f" in too_big and "free some space" not in too_big
    full = repairs.write_failure(run.dir, "metrics.jsonl", OSError(errno.ENOSPC, "No space left on device"))
    assert "free some space" in full


# --- a hostile colleague on a shared disk: nothing outside the run folder is read, written, renamed or
# deleted through a link, no FIFO blocks, no code runs, no half model is trained on -------------------


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """Two run folders stopped where the student's final model would be saved (their checkpoints stay):
    'grpo' (one phase) and 'retireopd' (a teacher/ and phase-2 checkpoints). Each test copies one."""
    root = tmp_path_factory.mktemp("stopped")
    with pytest.MonkeyPatch.context() as patch:
        for algo in ("grpo", "retireopd"):
            crash_instead_of_saving(patch, root / algo, ["--env", "webshop", "--algo", algo],
                                    lambda saved: saved == "student")
    return root


def stopped_copy(stopped_runs, tmp_path, algo="grpo"):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_runs / algo, run_dir, symlinks=True)
    return run_dir


def victim_of(tmp_path):
    """Another user's folder beside the run folder, and a fingerprint of everything in it."""
    victim = tmp_path / "victim"
    (victim / "0-student-00000").mkdir(parents=True)
    (victim / "0-student-00000" / "data.txt").write_text("another user's work\n")
    (victim / "notes.txt").write_text("another user's notes\n")
    return victim, lambda: sorted((str(p.relative_to(victim)), p.read_bytes() if p.is_file() else None)
                                  for p in victim.rglob("*"))


PLANTED = [  # (the entry, a link to the victim's file / folder or a FIFO, resumed or a new run)
    ("checkpoints", "folder", "resume"),  # before: rotation deleted the victim's 0-student-00000
    ("config.json.tmp", "file", "new"), ("eval.jsonl.tmp", "file", "resume"), ("events.jsonl.tmp", "file", "resume"),
    ("checkpoints/1-student-00003.tmp", "folder", "resume"), ("student.tmp", "folder", "resume"),
    (".retireopd.lock", "file", "new"), (".retireopd-write-test", "file", "new"), ("plot.png", "file", "resume"),
    ("metrics.jsonl", "dangling", "new"), ("tensorboard", "folder", "new"), ("tiny_base", "folder", "resume"),
    ("run.json", "fifo", "resume"), ("checkpoints/1-student-00002/trainer.pt", "fifo", "resume"),
    ("metrics.jsonl", "fifo", "new"), ("config.json", "fifo", "resume"), ("events.jsonl", "file", "resume"),
    ("metrics.jsonl", "hard link", "resume"), (".retireopd.lock", "hard link", "new"),
    ("checkpoints", "plain file", "resume"), ("config.json", "plain folder", "resume"),
]


@pytest.mark.parametrize("entry,kind,start", PLANTED, ids=[f"{e}-{k}-{s}" for e, k, s in PLANTED])
def test_a_link_or_fifo_among_a_run_folders_entries_is_refused_and_nothing_outside_changes(
        stopped_runs, tmp_path, entry, kind, start):
    victim, contents = victim_of(tmp_path)
    if start == "resume":
        run_dir = stopped_copy(stopped_runs, tmp_path)
    else:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
    path = run_dir / entry
    if path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "hard link":  # (the kernel's protected_hardlinks stops most of these; a test runs as root)
        os.link(victim / "notes.txt", path)
    elif kind.startswith("plain"):  # a file where the run keeps a folder, or the reverse: before, a traceback
        path.mkdir() if kind == "plain folder" else path.write_text("")
    else:
        path.symlink_to({"file": victim / "notes.txt", "folder": victim, "dangling": victim / "new.jsonl"}[kind])
    before = contents()
    argv = ["--resume", str(run_dir)] if start == "resume" else QUICK + [*GRPO, "--run-dir", str(run_dir)]
    said = {"hard link": "has 1 other hard link", "fifo": "is a FIFO.*remove it", "plain file": "is a file, where",
            "plain folder": "is a folder, where"}.get(kind, "is a link to.*remove it")
    one_line_refusal(argv, f"{path} {said}")
    assert contents() == before  # before: overwritten, truncated, deleted or created there; a FIFO blocked
    assert os.path.lexists(path)  # and the entry is left for its owner to look at


def test_a_run_folder_reached_through_a_link_works_as_before(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    run_dir, metrics, _ = run_cli(tmp_path, "via/run", *GRPO, "--iterations", "1")
    assert len(metrics) == 1 and (tmp_path / "real" / "run" / "student" / "model.safetensors").is_file()


def test_the_file_helpers_follow_no_link_and_wait_on_no_fifo(tmp_path):
    from common import append_line, checkpoint_folders, read_owned_text, remove_entry, write_text_atomically
    victim, contents = victim_of(tmp_path)
    before = contents()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json.tmp").symlink_to(victim / "notes.txt")  # planted while the run goes on
    write_text_atomically(folder / "config.json", "{}")
    assert (folder / "config.json").read_text() == "{}" and not os.path.lexists(folder / "config.json.tmp")
    (folder / "metrics.jsonl").symlink_to(victim / "notes.txt")
    with pytest.raises(OSError):
        append_line(folder / "metrics.jsonl", "{}")
    (folder / "checkpoints").symlink_to(victim)
    assert checkpoint_folders(folder) == []  # (the victim holds a folder named like a checkpoint)
    remove_entry(folder / "checkpoints")  # the link goes, never what it points to
    assert not os.path.lexists(folder / "checkpoints")
    os.mkfifo(folder / "run.json")
    with pytest.raises(OSError):  # at once: O_NONBLOCK, and not a regular file
        read_owned_text(folder / "run.json")
    assert contents() == before
    (folder / "teacher" / "deep").mkdir(parents=True)
    real_scandir = os.scandir
    with pytest.MonkeyPatch.context() as patch:  # (as root every folder can be listed: the refusal, simulated)
        patch.setattr(os, "scandir", lambda path=".": (_ for _ in ()).throw(PermissionError(
            13, "Permission denied", str(path))) if str(path).endswith("deep") else real_scandir(path))
        assert run_folder.run_folder_problem(folder) == f"cannot list {folder}/teacher/deep (Permission denied): " \
                                                    "the run must see everything in its own folders"


def test_a_model_saved_over_a_planted_link_writes_inside_the_folder(tmp_path, tiny):
    victim, contents = victim_of(tmp_path)
    before = contents()
    run = R.Run(small_cfg(run_dir=str(tmp_path / "run")))
    (run.dir / "student.tmp").symlink_to(victim)  # before: the model was written into the victim's folder
    (run.dir / "student").symlink_to(victim)  # and then renamed over it
    run.save_model(*tiny, "student", {"algo": "grpo"})
    assert (run.dir / "student").is_dir() and not (run.dir / "student").is_symlink()
    assert (run.dir / "student" / "model.safetensors").is_file() and contents() == before


def test_a_link_planted_above_an_entry_after_the_start_is_never_deleted_or_renamed_through(tmp_path, tiny):
    import common
    victim, contents = victim_of(tmp_path)
    (victim / "1-student-00000.tmp").mkdir()
    before = contents()
    run = R.Run(small_cfg(run_dir=str(tmp_path / "run"), keep_checkpoints=1))
    (run.dir / "checkpoints").symlink_to(victim)  # after the scan: before, rotation deleted the victim's folder
    with pytest.raises(SystemExit, match="a link, or not a folder, inside the run folder"):
        run.checkpoint(*tiny, {"phase": "student", "iteration": 1})
    for act in (lambda: common.remove_entry(run.dir / "checkpoints" / "0-student-00000", run.dir),
                lambda: common.rename_entry(run.dir / "checkpoints" / "1-student-00000.tmp",
                                            run.dir / "checkpoints" / "1-student-00000", run.dir)):
        with pytest.raises(OSError):
            act()
    assert contents() == before


def test_every_write_is_fsynced_before_its_rename_and_a_checkpoint_before_older_ones_go(tmp_path, tiny,
                                                                                         monkeypatch):
    import common
    story = []
    real_fsync, real_rename, real_rmtree = os.fsync, Path.rename, shutil.rmtree
    monkeypatch.setattr(common.os, "fsync", lambda fd: (story.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                        real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, to: (story.append(("rename", str(self))),
                                                          real_rename(self, to))[1])
    monkeypatch.setattr(common.shutil, "rmtree", lambda path, *a, **k: (story.append(("delete", str(path))),
                                                                        real_rmtree(path, *a, **k))[1])
    run = R.Run(small_cfg(run_dir=str(tmp_path / "run"), keep_checkpoints=1))
    run.log("metrics.jsonl", {"phase": "student", "iteration": 0})
    story.clear()
    for iteration in range(2):
        run.checkpoint(*tiny, {"phase": "student", "iteration": iteration})
    checkpoints = str(run.dir / "checkpoints")
    first, second = (f"{checkpoints}/1-student-0000{k}" for k in range(2))
    assert story[0] == ("fsync", str(run.dir / "metrics.jsonl"))  # the logs a checkpoint covers: first
    renamed = story.index(("rename", second + ".tmp"))
    written = {p for what, p in story[:renamed] if what == "fsync" and p.startswith(second + ".tmp/")}
    assert written == {str(p).replace(second, second + ".tmp") for p in Path(second).iterdir()}  # every file
    assert story.index(("fsync", checkpoints)) < story.index(("delete", first))  # its name durable, then rotation
    assert story.index(("delete", first)) > renamed and not Path(first).exists()
    story.clear()
    common.write_text_atomically(run.dir / "config.json", "{}")
    assert story == [("fsync", str(run.dir / "config.json.tmp")), ("fsync", str(run.dir))]


def with_auto_map(folder, marker):
    """A model folder whose config names custom code that would leave `marker` when it runs."""
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import Qwen2Config as EvilConfig\n")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "evil.EvilConfig"}}))


def test_a_model_that_names_custom_code_is_refused_and_none_of_it_runs(stopped_runs, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked on stdin whether to run a folder's code"))
    marker = tmp_path / "the-code-ran"
    run_dir = stopped_copy(stopped_runs, tmp_path)
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    with_auto_map(newest, marker)  # before: "run the custom code? [y/N]"; y ran evil.py
    R.main(["--resume", str(run_dir)])
    assert "names custom code (auto_map)" in capsys.readouterr().out and (run_dir / "student").is_dir()
    assert not marker.exists() and newest.with_name(newest.name + ".corrupt").is_dir()
    model = tmp_path / "model"
    shutil.copytree(run_dir / "student", model)
    with_auto_map(model, marker)
    one_line_refusal(QUICK + [*GRPO, "--model", str(model), "--run-dir", str(tmp_path / "m")],
                     "config.json names custom code \\(auto_map\\)")
    assert not marker.exists()
    tiny_model, tokenizer = R.load_policy(str(run_dir / "student"), torch.device("cpu"), torch.float32)
    tiny_model.config.auto_map = {"AutoConfig": "evil.EvilConfig"}  # a hub model that names code it does not need
    saved = R.Run(small_cfg(run_dir=str(tmp_path / "s"))).save_model(tiny_model, tokenizer, "student")
    assert model_sources.saved_model_problem(saved) is None  # what a run saves names no code: its resume loads it


@pytest.mark.parametrize("damage,problem", [
    ("tokenizer.json", "no tokenizer"), ("chat_template.jinja", "no chat template"),
    ("empty chat_template.jinja", "no chat template"), ("other tokenizer", "not the one the run trained with")])
def test_a_checkpoint_without_its_tokenizer_or_chat_template_is_set_aside(stopped_runs, tmp_path, capsys, damage,
                                                                          problem):
    run_dir = stopped_copy(stopped_runs, tmp_path)
    older, newest = sorted((run_dir / "checkpoints").iterdir())
    if damage == "other tokenizer":  # loads, but other ids: trainer.pt remembers the run's
        vocab = json.loads((newest / "tokenizer.json").read_text())
        first, second = list(vocab["model"]["vocab"])[5:7]
        vocab["model"]["vocab"][first], vocab["model"]["vocab"][second] = (vocab["model"]["vocab"][second],
                                                                           vocab["model"]["vocab"][first])
        (newest / "tokenizer.json").write_text(json.dumps(vocab))
    elif damage.startswith("empty"):
        (newest / "chat_template.jinja").write_text("")
    else:
        (newest / damage).unlink()  # before: a 3-token tokenizer trained on in silence, or a traceback
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])
    said = capsys.readouterr().out
    assert f"checkpoint {newest.name} is not usable" in said and problem in said
    resumed = [e for e in R.read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed[-1]["checkpoint"] == older.name
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


@pytest.mark.parametrize("lost,problem", [("tokenizer.json", "no tokenizer"),
                                          ("chat_template.jinja", "no chat template")])
def test_a_model_folder_without_a_tokenizer_or_chat_template_is_refused_in_one_line(stopped_runs, tmp_path, lost,
                                                                                    problem):
    model = tmp_path / "model"
    shutil.copytree(sorted((stopped_runs / "grpo" / "checkpoints").iterdir())[-1], model)
    (model / lost).unlink()  # before: trained on a 3-token tokenizer in silence, or a traceback in the rollout
    one_line_refusal(QUICK + [*GRPO, "--model", str(model), "--run-dir", str(tmp_path / "m")], problem)
    assert not (tmp_path / "m").exists()
    if lost == "tokenizer.json":  # a SentencePiece tokenizer is one too
        (model / "tokenizer.model").write_bytes(b"")
        assert model_sources.saved_model_problem(model) is None


def test_a_fifo_in_a_model_folder_is_refused_at_once(stopped_runs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(sorted((stopped_runs / "grpo" / "checkpoints").iterdir())[-1], model)
    os.mkfifo(model / "extra.json")  # before: open() waited for a writer, forever
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("blocked on the FIFO"))
    signal.alarm(60)
    try:
        one_line_refusal(QUICK + [*GRPO, "--model", str(model), "--run-dir", str(tmp_path / "m")],
                         "extra.json is neither a file nor a folder")
    finally:
        signal.alarm(0)


def test_a_model_folder_of_links_loads_as_the_hub_cache_lays_it_out(stopped_runs, tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    shutil.copytree(sorted((stopped_runs / "grpo" / "checkpoints").iterdir())[-1], blobs)
    snapshot.mkdir(parents=True)
    for blob in blobs.iterdir():  # a source is only read: its links are the cache's own layout, not an attack
        (snapshot / blob.name).symlink_to(blob)
    _, metrics, _ = run_cli(tmp_path, "run", *GRPO, "--model", str(snapshot), "--iterations", "1")
    assert len(metrics) == 1


def test_a_phase_two_checkpoint_without_its_teacher_is_refused_and_no_phase_is_redone(stopped_runs, tmp_path):
    run_dir = stopped_copy(stopped_runs, tmp_path, "retireopd")
    shutil.rmtree(run_dir / "teacher")
    logs = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "eval.jsonl")}
    one_line_refusal(["--resume", str(run_dir)], "continues phase 2, but its teacher .* is gone: put that folder back")
    assert logs == {name: (run_dir / name).read_text() for name in logs}  # before: both phases redone, twice logged


@pytest.mark.parametrize("damage", ["emptied", "removed"])
def test_a_lost_config_json_is_restored_from_the_newest_checkpoint(stopped_runs, tmp_path, capsys, damage):
    run_dir = stopped_copy(stopped_runs, tmp_path)
    saved = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text("") if damage == "emptied" else (run_dir / "config.json").unlink()
    R.main(["--resume", str(run_dir)])  # before: no resume possible, although both checkpoints are whole
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert f"config.json is {'damaged' if damage == 'emptied' else 'missing'}: the run's settings are restored " \
           f"from checkpoint {newest.name}" in capsys.readouterr().out
    assert json.loads((run_dir / "config.json").read_text()) == {**saved, "run_dir": str(run_dir)}  # (a copy)
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


def test_a_lost_log_line_that_a_checkpoint_covers_is_reported_as_a_hole(stopped_runs, tmp_path, capsys):
    run_dir = stopped_copy(stopped_runs, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join([lines[0], lines[2]]) + "\n")  # student 1 lost
    R.main(["--resume", str(run_dir)])  # before: dropped in silence
    assert "metrics.jsonl has no line for 1 iteration(s) that the checkpoint covers (student 1)" in \
        capsys.readouterr().out
    assert repairs.log_holes(run_dir, ("student",), "student", 2, {}) is not None
    assert repairs.log_holes(run_dir, ("student",), "student", 0, {}) is None
    assert "(teacher 0, teacher 1)" in repairs.log_holes(run_dir, ("teacher", "student"), "student", 0,
                                                                {"teacher": 1})


def test_an_empty_catalogue_is_refused_before_the_folder_is_taken(tmp_path):
    shop = tmp_path / "shop"
    write_catalogue(shop, [])
    one_line_refusal(QUICK + [*GRPO, "--webshop-data", str(shop), "--run-dir", str(tmp_path / "s")],
                     "yields no training and no validation and no report task")
    assert not (tmp_path / "s").exists()  # before: IndexError, and the folder blocked the corrected command


def test_a_permission_error_is_one_line(tmp_path):
    """As root no file is unreadable: the refusal is raised where a non-root user meets it (a resume's
    config.json), in a fresh interpreter that runs retireopd.py as a script."""
    script = ("import runpy, settings, sys\n"
              "def denied(*a, **k): raise PermissionError(13, 'Permission denied', sys.argv[-1] + '/config.json')\n"
              "settings.saved_settings = denied\n"
              "runpy.run_path('retireopd.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script, "--resume", str(tmp_path)], cwd=HERE, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"retireopd: permission denied: {tmp_path}/config.json (this user may not read or write it: ask its owner, "
        "or choose another --run-dir / data folder)"]
