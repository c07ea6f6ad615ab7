"""Every laptop a class brings, simulated: none of us has a Mac or a Windows machine, so the demo and a
kill-and-resume run here in a subprocess whose project files see what those platforms offer. A
sitecustomize.py on PYTHONPATH wraps __import__ for the project's own files: on "macos" they find no /proc;
on "windows" also no fcntl, resource, termios, pwd or grp module, an `os` without O_NOFOLLOW, O_NONBLOCK,
O_DIRECTORY, uname, getuid, geteuid, getgid, fork or mkfifo, a `signal` without SIGHUP, SIGKILL, SIGUSR1,
SIGUSR2 or SIGALRM, and standard streams in Windows' cp1252. Third-party code keeps the real modules (on a
real Mac or Windows machine it has its own). What this cannot show: a `sys.platform` branch (the project
reads it once, for getrusage's unit), Windows' paths, its file sharing (an open file cannot be deleted
there) and its signals; docs/running.md says so.

The fallbacks themselves are also tested in-process, in the fast tier: the run folder's link and FIFO
refusals without O_NOFOLLOW and O_NONBLOCK, the lock without fcntl, the memory gauges without /proc."""

import ast
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
import memory
import retireopd as R
import run_folder
from conftest import comparable, phases

HERE = Path(__file__).resolve().parent

SITECUSTOMIZE = r'''
"""A Mac or a Windows machine as the project's own files see it (test_platforms.py)."""
import builtins, io, os, signal, sys, sysconfig, types

PROJECT = os.path.realpath(os.environ["SIMULATED_PROJECT"]) + os.sep
PLATFORM = os.environ["SIMULATED_PLATFORM"]
WINDOWS = PLATFORM == "windows"
HIDDEN_MODULES = {"fcntl", "resource", "termios", "pwd", "grp"} if WINDOWS else set()
HIDDEN_OS = {"O_NOFOLLOW", "O_NONBLOCK", "O_DIRECTORY", "uname", "getuid", "geteuid", "getgid", "fork",
             "mkfifo"} if WINDOWS else set()
HIDDEN_SIGNAL = {"SIGHUP", "SIGKILL", "SIGUSR1", "SIGUSR2", "SIGALRM"} if WINDOWS else set()
OURS, STDLIB = os.path.realpath(__file__), os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def project_file(name):
    name = os.path.realpath(name or "")
    return name.startswith(PROJECT) and "site-packages" not in name


def called_from_project():
    """The first caller outside this file and the standard library is a project file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<") or os.path.realpath(name) == OURS or os.path.realpath(name).startswith(STDLIB)):
            return project_file(name)
        frame = frame.f_back
    return False


def without_proc(real):
    def opener(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith("/proc") and called_from_project():
            raise FileNotFoundError(2, f"No such file or directory (simulated {PLATFORM})", os.fspath(file))
        return real(file, *args, **kwargs)
    return opener


def copy_without(module, names):
    copy = types.ModuleType(module.__name__, module.__doc__)
    copy.__dict__.update({key: value for key, value in vars(module).items() if key not in names})
    return copy


builtins.open = io.open = without_proc(io.open)
SIMULATED = {"os": copy_without(os, HIDDEN_OS), "signal": copy_without(signal, HIDDEN_SIGNAL)}
SIMULATED["os"].open = without_proc(os.open)
real_import = builtins.__import__


def simulated_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = globals if globals is not None else sys._getframe(1).f_globals  # (a call of __import__ itself)
    if level == 0 and project_file(importer.get("__file__")):
        top = name.partition(".")[0]
        if top in HIDDEN_MODULES:
            raise ModuleNotFoundError(f"No module named {name!r} (simulated {PLATFORM})", name=name)
        if top in SIMULATED:
            real_import(name, globals, locals, fromlist, level)
            return SIMULATED[top]
    return real_import(name, globals, locals, fromlist, level)


builtins.__import__ = simulated_import
'''


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    """platform -> the environment of a subprocess that runs on it, as the project's files see it."""
    folder = tmp_path_factory.mktemp("simulation")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")

    def environment(platform: str, project: Path = HERE) -> dict:
        return {**os.environ, "PYTHONPATH": str(folder), "SIMULATED_PROJECT": str(project),
                "SIMULATED_PLATFORM": platform, "OMP_NUM_THREADS": "1",
                "PYTHONIOENCODING": "cp1252" if platform == "windows" else "utf-8"}
    return environment


PROBE = """
import json, os, pathlib, signal
import tqdm  # (third-party code imports and runs with the real modules)

def imports(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False

def reads(open_it):
    try:
        return bool(open_it())
    except OSError:
        return False

print(json.dumps({"fcntl": imports("fcntl"), "resource": imports("resource"),
                  "open_proc": reads(lambda: open("/proc/self/status").read()),
                  "path_proc": reads(lambda: pathlib.Path("/proc/self/status").read_text()),
                  "O_NOFOLLOW": hasattr(os, "O_NOFOLLOW"), "uname": hasattr(os, "uname"),
                  "SIGHUP": hasattr(signal, "SIGHUP"), "SIGTERM": hasattr(signal, "SIGTERM"),
                  "stdlib_os": hasattr(__import__("shutil").os, "O_NOFOLLOW")}))
"""


def test_the_simulation_hides_what_the_platform_lacks_from_project_files_only(simulation, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    lacks = {}
    for platform in ("linux", "macos", "windows"):
        env = simulation(platform, tmp_path) if platform != "linux" else dict(os.environ)
        done = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        lacks[platform] = {name for name, present in json.loads(done.stdout).items() if not present}
    assert lacks == {"linux": set(), "macos": {"open_proc", "path_proc"},
                     "windows": {"fcntl", "resource", "open_proc", "path_proc", "O_NOFOLLOW", "uname", "SIGHUP"}}


def run_quietly(command: list, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=600, **kwargs)


DEMO = [sys.executable, "retireopd.py", "--iterations", "3", "--teacher-iterations", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["macos", "windows"])
def test_the_demo_and_a_kill_and_resume_run_on_a_simulated_platform(simulation, tmp_path, platform):
    env = simulation(platform)
    whole = tmp_path / "whole"
    done = run_quietly([*DEMO, "--run-dir", str(whole)], env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "[retireopd] done in" in done.stdout and (whole / "student" / "config.json").is_file()
    metrics = R.read_jsonl(whole / "metrics.jsonl")
    assert phases(metrics) == [(p, k) for p in ("teacher", "student") for k in range(3)]
    peaks = {m["peak_mem_gb"] for m in metrics}
    if platform == "windows":  # no /proc and no getrusage: the figure is missing, said as null, never 0
        assert peaks == {None}
    else:  # getrusage's peak (in KiB here: the real resource module is Linux's, as sys.platform says)
        assert all(isinstance(p, float) and 0.05 < p < 64 for p in peaks), peaks
    assert (whole / "plot.png").is_file() and (whole / "eval.jsonl").is_file()
    # killed (as a closed laptop lid or the task manager would) once phase 2 has checkpoints, then resumed;
    # while it runs, a second start of its folder is refused (Windows: filelock's lock, which names no holder)
    killed = tmp_path / "killed"
    process = subprocess.Popen([*DEMO, "--save-every", "1", "--run-dir", str(killed)], cwd=HERE, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second, deadline = None, time.time() + 300
    while time.time() < deadline and process.poll() is None:
        logged = R.read_jsonl(killed / "metrics.jsonl")
        if logged and second is None:
            second = subprocess.Popen([sys.executable, "retireopd.py", "--resume", str(killed)], cwd=HERE, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if any(m["phase"] == "student" and m["iteration"] >= 1 for m in logged) and second.poll() is not None:
            process.kill()
            break
        time.sleep(0.05)
    process.wait()
    assert process.returncode != 0, "the run finished before it could be killed"
    holder, refusal = "another process" if platform == "windows" else "process ", second.stderr.read().strip()
    assert second.returncode == 1 and refusal.startswith(f"retireopd: {killed} is in use by {holder}"), refusal
    resumed = run_quietly([sys.executable, "retireopd.py", "--resume", str(killed)], env)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    after = R.read_jsonl(killed / "metrics.jsonl")
    assert phases(after) == phases(metrics)  # every iteration logged exactly once
    assert comparable(after) == comparable(metrics)  # (--save-every changes no number)
    ours = R.load_policy(str(killed / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    theirs = R.load_policy(str(whole / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    drawn = run_quietly([sys.executable, "retireopd.py", "--compare", str(whole), str(killed)], env)
    assert drawn.returncode == 0 and "Traceback" not in drawn.stderr, drawn.stderr


# --- the fallbacks, in-process -----------------------------------------------------------------------


@pytest.fixture
def without_nofollow(monkeypatch):
    """common's file helpers as on a platform without O_NOFOLLOW, O_NONBLOCK and folders that open (Windows)."""
    monkeypatch.setattr(common, "NOFOLLOW", 0)
    monkeypatch.setattr(common, "NONBLOCK", 0)
    monkeypatch.setattr(common, "OPENS_FOLDERS", False)


def test_without_o_nofollow_the_file_helpers_still_follow_no_link_and_wait_on_no_fifo(tmp_path, without_nofollow):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("theirs", encoding="utf-8")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json.tmp").symlink_to(victim / "notes.txt")  # planted while the run goes on
    common.write_text_atomically(folder / "config.json", "{}")
    assert (folder / "config.json").read_text(encoding="utf-8") == "{}"
    (folder / "metrics.jsonl").symlink_to(victim / "notes.txt")
    with pytest.raises(OSError) as refused:
        common.append_line(folder / "metrics.jsonl", "{}")
    assert refused.value.errno == errno.ELOOP
    (folder / "events.jsonl").symlink_to(victim / "new.txt")  # a dangling link: nothing may be created through it
    with pytest.raises(OSError):
        common.append_line(folder / "events.jsonl", "{}")
    with pytest.raises(OSError):
        common.read_owned_text(folder / "metrics.jsonl")
    os.mkfifo(folder / "run.json")
    with pytest.raises(OSError) as refused:  # refused before it is opened: nothing waits on it
        common.read_owned_text(folder / "run.json")
    assert refused.value.errno == errno.EINVAL
    common.fsync_path(folder)  # a platform that cannot open a folder: skipped, not an error
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]
    assert (victim / "notes.txt").read_text(encoding="utf-8") == "theirs"
    common.append_line(folder / "eval.jsonl", '{"a": 1}')  # what the run owns works as before
    common.append_line(folder / "eval.jsonl", '{"a": 2}')
    assert common.read_owned_text(folder / "eval.jsonl") == '{"a": 1}\n{"a": 2}\n'


def test_without_o_nofollow_an_entry_swapped_for_a_link_while_it_is_opened_is_refused(tmp_path, without_nofollow,
                                                                                        monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("theirs", encoding="utf-8")
    log = tmp_path / "metrics.jsonl"
    log.write_text("", encoding="utf-8")
    real_lstat = os.lstat

    def lstat_then_swap(path, *args, **kwargs):  # the run looks, then someone puts a link in the file's place
        seen = real_lstat(path, *args, **kwargs)
        if Path(path) == log:
            log.unlink()
            log.symlink_to(victim)
        return seen
    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    with pytest.raises(OSError) as refused:
        common.append_line(log, "{}")
    assert refused.value.errno == errno.ELOOP
    assert victim.read_text(encoding="utf-8") == "theirs"


def test_without_fcntl_the_lock_is_filelocks_and_a_second_process_is_refused(tmp_path, monkeypatch, simulation):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` now fails, as on Windows
    folder = tmp_path / "run"
    folder.mkdir()
    run_folder.lock_run_folder(folder)
    try:
        assert isinstance(run_folder.HELD_LOCKS[str((folder / run_folder.LOCK_FILE).resolve())],
                          run_folder.FileLockHolder)
        run_folder.name_the_holder(folder)  # (filelock's file: not written into)
        other = subprocess.run([sys.executable, "-c", "import sys, run_folder; from pathlib import Path; "
                                "run_folder.lock_run_folder(Path(sys.argv[1]))", str(folder)], cwd=HERE,
                               env=simulation("windows"), capture_output=True, text=True, timeout=120)
        assert other.returncode == 1 and "is in use by another process: one process per run folder" in other.stderr
        (folder / "link").symlink_to(tmp_path)
        with pytest.raises(SystemExit, match="is a link"):
            run_folder.lock_without_flock(tmp_path, folder / "link")
    finally:
        run_folder.release_run_folders()
    run_folder.lock_run_folder(folder)  # released: free again
    run_folder.release_run_folders()


def test_without_proc_the_gauges_use_getrusage_or_say_they_have_no_figure(monkeypatch):
    linux = memory.process_memory_gb("VmHWM")
    assert 0.05 < linux < 64
    real_open = open

    def no_proc(file, *args, **kwargs):
        if str(file).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr("builtins.open", no_proc)
    peak = memory.process_memory_gb("VmHWM")  # macOS: getrusage (Linux's unit here, KiB)
    assert abs(peak - linux) / linux < 0.5
    assert memory.process_memory_gb("VmRSS") is None
    memory.reset_peak_memory(torch.device("cpu"))  # no clear_refs: nothing to reset, no error
    monkeypatch.setitem(sys.modules, "resource", None)  # Windows: no getrusage either
    assert memory.peak_memory_gb(torch.device("cpu")) is None
    assert memory.memory_above(None, 1.0) is None and memory.memory_above(2.0, 1.5) == 0.5


def test_every_text_file_the_project_opens_names_its_encoding():
    # Windows opens text in the locale's encoding (cp1252), Linux and macOS in UTF-8: a file written on one and
    # read on the other, or a tokenizer's UTF-8 read as cp1252, would change; so every text open says utf-8
    missing = []
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            module = getattr(getattr(node.func, "value", None), "id", None)
            if name not in ("open", "read_text", "write_text", "fdopen") or (name == "open" and module == "os"):
                continue
            modes = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            modes += [k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if any("b" in mode for mode in modes) or any(k.arg == "encoding" for k in node.keywords):
                continue
            if name == "open" and module not in (None, "io") and not modes:  # Path.open("r") and the like only
                continue
            missing.append(f"{path.name}:{node.lineno}")
    assert not missing, f"text opened without encoding=: {missing}"


def test_the_stop_signals_are_those_the_platform_has():
    # SIGHUP is Unix's, SIGBREAK Windows' (Ctrl-Break): the script registers whichever exist, by name (the
    # simulated Windows runs above have no SIGHUP; this says why they start)
    source = (HERE / "retireopd.py").read_text(encoding="utf-8")
    main_block = source[source.index('if __name__ == "__main__":'):]
    assert "signal.SIGHUP" not in main_block and '"SIGHUP"' in main_block and "hasattr(signal, name)" in main_block
