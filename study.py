"""The offline demo's story over seeds: every --algo of the kitchen, per seed, in one table and one figure.

    python study.py                                    # seeds 0-4, two runs at a time, into runs/study
    python study.py --seeds 5 6 7 --jobs 1 --out runs/check
    python study.py --figure docs/demo_compare.png     # also regenerate the README's figure
    python study.py --teachers teachers --out runs/lab-lambda --variants retireopd grpo+opd -- --opd-coef 0.01
    python study.py --build-teachers                   # train the shipped teachers/ again (phase 1 of seeds 0-4)

For each seed it runs `python retireopd.py --model tiny --seed S` (phase 1, then RetireOPD's phase 2),
then, reusing that seed's teacher (`--teacher`, so phase 1 runs once per seed), phase 2 of
`grpo+opd`, `opd`, `--retire-at` early and late, and `--algo grpo` (no teacher). The warm-started
base model is built once and copied into every run folder (it is the same for every seed). Each run
is its own run folder under OUT/seed<S>/<variant>; a finished one is reused, an interrupted one
resumed, so the study can be stopped and started again. The table reads the run folders' logs:

    base+skills, base    the base model's validation before phase 1, with and without skills
    S_T                  the teacher's validation success with skills (the mean of its last two)
    teacher              the teacher's report with skills (the report panel, end of phase 1)
    retired              the first phase-2 iteration RetireOPD ran without the teacher (- never)
    retireopd ... grpo   each student's report (the report panel, end of phase 2)

and below it each claim of the paper, with the seeds on which it holds and its mean margin. Runs
differ between machines (RL amplifies float differences between CPUs), so the claims are counted
over seeds, never read off one seed. Every flag after `--` goes to every run.

For the labs (docs/labs.md): with --teachers STUDY each seed reuses STUDY's teacher and base model,
so phase 1 never runs: `retireopd` is then phase 2 alone (`--teacher`), and the columns of the
teacher side (base+skills, base, S_T, teacher) are read from STUDY. The project ships the teachers of
seeds 0-4 in that layout (--teachers teachers; without a base model of their own: the project's
tiny_base/, which they were trained from); --build-teachers trains them again (phase 1 alone) and
writes them there. --base-from STUDY reuses only its base model (phase 1 runs again). --script FILE
runs FILE instead of retireopd.py: a lab's change to the method, a few lines that import retireopd,
change one thing, call main().
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import remove_entry, rename_entry, write_bytes_atomically, write_text_atomically

HERE = Path(__file__).resolve().parent
TEACHERS = HERE / "teachers"  # the labs' teachers of seeds 0-4, as a study holds them (build_teachers writes them)
SHIPPED_BASE = HERE / "tiny_base"  # the project's base model (retireopd.SHIPPED_BASE), which they were trained from

# variant -> the flags of its run (beside --model tiny --seed S); TEACHER and EARLY/LATE are filled in
VARIANTS = {
    "retireopd": ["--algo", "retireopd"],  # phase 1 (the teacher) and RetireOPD's phase 2
    "grpo+opd": ["--algo", "grpo+opd", "--teacher", "TEACHER"],  # never retired
    "opd": ["--algo", "opd", "--teacher", "TEACHER"],  # pure distillation
    "grpo": ["--algo", "grpo"],  # the RL baseline, no teacher
    "retire-early": ["--algo", "retireopd", "--teacher", "TEACHER", "--retire-at", "EARLY"],
    "retire-late": ["--algo", "retireopd", "--teacher", "TEACHER", "--retire-at", "LATE"],
}
# (name, the two columns it compares, at-or-below allowed): margin = first - second
CLAIMS = [
    ("phase 1 makes the teacher: S_T above the base model with skills", "S_T", "base+skills"),
    ("never retired caps the student: retireopd above grpo+opd", "retireopd", "grpo+opd"),
    ("pure distillation stays at or below its teacher: S_T minus opd", "S_T", "opd"),
    ("... on the same panel: the teacher's report minus opd, at or below", "teacher", "opd"),
    ("the retired student passes its teacher: retireopd above S_T", "retireopd", "S_T"),
    ("... on the same panel: retireopd above the teacher's report", "retireopd", "teacher"),
    ("... and GRPO alone: retireopd above grpo", "retireopd", "grpo"),
]


# "at" its teacher: within one episode of the validation panel (48 episodes: 1/48 = 0.021), which is what
# one more or one fewer win moves S_T by (fixed before the study that reports it was run)
AT = 1 / 48


def read_jsonl(path: Path) -> list:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a last line cut short by a crash: the run will be resumed
    return records


def finished(run_dir: Path) -> bool:
    return any(e.get("event") == "done" for e in read_jsonl(run_dir / "events.jsonl"))


def command(variant: str, seed: int, run_dir: Path, teacher: Path, early: int, late: int, extra: list,
            reuse_teacher: bool = False, script: Path = HERE / "retireopd.py") -> list:
    """The command of one run. reuse_teacher: retireopd too starts from `teacher` (phase 2 alone)."""
    flags = VARIANTS[variant] + (["--teacher", "TEACHER"] if reuse_teacher and "TEACHER" not in VARIANTS[variant]
                                 and variant != "grpo" else [])
    flags = [{"TEACHER": str(teacher), "EARLY": str(early), "LATE": str(late)}.get(f, f) for f in flags]
    if (run_dir / "config.json").is_file():  # started before: continue it (a finished run is not started)
        return [sys.executable, str(script), "--resume", str(run_dir)]
    return [sys.executable, str(script), "--model", "tiny", "--seed", str(seed), "--run-dir",
            str(run_dir), *flags, *extra]


def child_env() -> dict:
    """The runs' environment: ours, with this folder on the import path (a lab's --script imports retireopd)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}


def run_all(seeds: list, out: Path, jobs: int, early: int, late: int, extra: list, variants: list,
            teachers: Path = None, base_from: Path = None, script: Path = HERE / "retireopd.py") -> float:
    """Run every (seed, variant) not finished yet, `jobs` at a time, each when what it needs exists:
    the warm-started base (built by the first seed's retireopd run) and, for the variants that reuse
    it, its seed's teacher (from `teachers`, another study, when given). Returns the wall time in seconds."""
    started = time.time()
    home = teachers or out  # the study whose retireopd runs hold the teachers
    base = (teachers or base_from or out) / f"seed{seeds[0]}" / "retireopd" / "tiny_base"
    if (teachers or base_from) and not base.exists():  # the shipped teachers/: trained from the project's base
        base = SHIPPED_BASE
    todo = [(seed, variant) for variant in variants for seed in seeds]  # every seed's teacher first
    todo = [job for job in todo if not finished(out / f"seed{job[0]}" / job[1])]
    running: dict = {}
    while todo or running:
        for job, (process, log) in list(running.items()):
            if process.poll() is not None:
                log.close()
                del running[job]
                if process.returncode != 0:
                    raise SystemExit(f"study: seed {job[0]} {job[1]} failed (exit {process.returncode}); see "
                                     f"{out / f'seed{job[0]}' / (job[1] + '.log')}")
                print(f"[study] done: seed {job[0]} {job[1]} ({time.time() - started:.0f}s)", flush=True)
        for job in list(todo):
            if len(running) >= jobs:
                break
            seed, variant = job
            run_dir, teacher = out / f"seed{seed}" / variant, home / f"seed{seed}" / "retireopd" / "teacher"
            first = teachers is None and base_from is None and (seed, variant) == (seeds[0], "retireopd")
            if not first and not (base / "retireopd.json").is_file():
                if teachers or base_from:
                    raise SystemExit(f"study: {teachers or base_from} holds no base model for seed {seeds[0]} "
                                     f"({base})")
                continue  # the base model is not built yet
            if ("TEACHER" in VARIANTS[variant] or teachers) and variant != "grpo" \
                    and not (teacher / "retireopd.json").is_file():
                if teachers is not None:
                    raise SystemExit(f"study: {teachers} holds no teacher for seed {seed} ({teacher})")
                continue
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            if not first and not (run_dir / "tiny_base").exists():
                run_dir.mkdir(exist_ok=True)
                shutil.copytree(base, run_dir / "tiny_base")
            log = open(run_dir.parent / f"{variant}.log", "a", encoding="utf-8")
            process = subprocess.Popen(command(variant, seed, run_dir, teacher, early, late, extra,
                                               teachers is not None, script), cwd=HERE, env=child_env(),
                                       stdout=log, stderr=subprocess.STDOUT)
            running[job] = (process, log)
            todo.remove(job)
            print(f"[study] started: seed {seed} {variant}", flush=True)
        time.sleep(1)
    return time.time() - started


def teacher_flags(seed: int) -> list:
    """The flags of the run that trains seed `seed`'s shipped teacher: phase 1 alone. --algo skill-grpo trains
    the teacher of the study's retireopd run, bit for bit (the same phase 1), and adds a report without skills."""
    return ["--model", "tiny", "--seed", str(seed), "--algo", "skill-grpo"]


def build_teachers(seeds: list, jobs: int, scratch: Path, into: Path = TEACHERS) -> None:
    """into/seedS/retireopd for each seed, in a study's layout (--teachers reads it): phase 1 run anew in
    scratch/seedS/skill-grpo from the project's base model (copied in), `jobs` at a time, then its teacher
    folder as the run saved it, its eval.jsonl (phase 1's evaluations) and build.json (how it was built:
    the flags, the run's settings, the key of the base model it started from, the machine, the weights' sha256)."""
    def build(seed: int) -> None:
        run_dir = scratch / f"seed{seed}" / "skill-grpo"
        log_path = run_dir.parent / "skill-grpo.log"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_entry(run_dir, scratch)  # (left by an earlier build: every build trains anew)
        run_dir.mkdir()
        shutil.copytree(SHIPPED_BASE, run_dir / "tiny_base")  # (reused as it is, as a study's runs reuse theirs)
        with open(log_path, "w", encoding="utf-8") as log:
            done = subprocess.run([sys.executable, str(HERE / "retireopd.py"), *teacher_flags(seed), "--run-dir",
                                   str(run_dir)], cwd=HERE, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"study: the teacher of seed {seed} failed (exit {done.returncode}); see {log_path}")
        settings = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        del settings["run_dir"]  # (the scratch folder's)
        record = {"built_by": "python study.py --build-teachers", "flags": teacher_flags(seed), "settings": settings,
                  "base_key": json.loads((run_dir / "tiny_base" / "retireopd.json").read_text(encoding="utf-8"))["key"],
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
                  "wall_s": [e["wall_s"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "done"][0]}
        folder, tmp = into / f"seed{seed}" / "retireopd", into / f"seed{seed}" / "retireopd.tmp"
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_entry(tmp, into)  # (never through a link: copied into a new folder, renamed over the old one)
        shutil.copytree(run_dir / "teacher", tmp / "teacher", copy_function=shutil.copyfile)
        record["weights_sha256"] = hashlib.sha256((tmp / "teacher" / "model.safetensors").read_bytes()).hexdigest()
        write_text_atomically(tmp / "eval.jsonl", (run_dir / "eval.jsonl").read_text(encoding="utf-8"))
        write_text_atomically(tmp / "build.json", json.dumps(record, indent=2) + "\n")
        rename_entry(tmp, folder, into)
        s_t = json.loads((folder / "teacher" / "retireopd.json").read_text(encoding="utf-8"))["teacher_success"]
        print(f"[study] teacher of seed {seed}: S_T {s_t:.2f}, in {folder} ({record['wall_s']:.0f}s)", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(build, seeds))  # (a seed that failed raises here, once the others are done)


def report(run_dir: Path, phase: str, skills: bool):
    """The report panel's success of `phase` (with or without skills), or None."""
    for record in read_jsonl(run_dir / "eval.jsonl"):
        if record.get("panel") == "report" and record["phase"] == phase and record["skills"] == skills:
            return record["overall"]
    return None


def seed_row(folder: Path, teacher_folder: Path = None) -> dict:
    """One seed's columns (see the module docstring), read from its run folders; the teacher side from
    teacher_folder (another study's seed folder, --teachers) when given."""
    full, home = folder / "retireopd", (teacher_folder or folder) / "retireopd"
    before = {r["skills"]: r["overall"] for r in read_jsonl(home / "eval.jsonl")
              if r.get("before_training") and r["phase"] == "teacher"}
    teacher = json.loads((home / "teacher" / "retireopd.json").read_text(encoding="utf-8"))
    retired = [e["retired_at"] for e in read_jsonl(full / "events.jsonl") if e["event"] == "retirement"]
    row = {"base+skills": before.get(True), "base": before.get(False), "S_T": teacher["teacher_success"],
           "teacher": report(home, "teacher", True), "retired": retired[0] if retired else None}
    for variant in VARIANTS:
        row[variant] = report(folder / variant, "student", False)
    return row


def claims(rows: dict) -> list:
    """(claim, seeds on which it holds, number of seeds, mean margin) for each claim in CLAIMS. A
    claim holds on a seed when its margin is > 0 (for 'at or below': >= -AT, within one validation episode)."""
    out = []
    for name, first, second in CLAIMS:
        margins = [row[first] - row[second] for row in rows.values()
                   if row.get(first) is not None and row.get(second) is not None]
        holds = sum(m >= -AT if "at or below" in name else m > 0 for m in margins)
        out.append((name, holds, len(margins), sum(margins) / len(margins) if margins else float("nan")))
    return out


def format_table(rows: dict) -> str:
    columns = ["base+skills", "base", "S_T", "teacher", "retired", *VARIANTS]
    fmt = lambda v: "-" if v is None else (str(v) if isinstance(v, int) else f"{v:.2f}")  # noqa: E731
    lines = ["| seed | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    lines += [f"| {seed} | " + " | ".join(fmt(row[c]) for c in columns) + " |" for seed, row in rows.items()]
    lines += ["", "| claim | seeds | mean margin |", "|---|---|---|"]
    lines += [f"| {name} | {holds} of {n} | {margin:+.2f} |" for name, holds, n, margin in claims(rows)]
    return "\n".join(lines)


def draw(rows: dict, out: Path, figures: list) -> None:
    """Every run's phase 2 (its validations), one panel per seed, with S_T and the retirement marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[study] no figure: `pip install matplotlib`")
        return
    seeds = list(rows)
    cols = min(len(seeds), 3)
    fig, axes = plt.subplots((len(seeds) + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.2 * ((len(seeds) + cols - 1)
                             // cols)), sharey=True, squeeze=False)
    for ax, seed in zip(axes.flat, seeds):
        for n, variant in enumerate(VARIANTS):
            points = [(r["iteration"], r["overall"]) for r in read_jsonl(out / f"seed{seed}" / variant / "eval.jsonl")
                      if r["phase"] == "student" and r["panel"] == "validation"]
            if points and points[0][0] >= 0 and rows[seed]["base"] is not None:  # a phase 2 with a teacher does
                points.insert(0, (-1, rows[seed]["base"]))  # not validate first: the base model's, without skills
            if points:
                ax.plot(*zip(*points), "o-" if variant == "retireopd" else ".-", color=f"C{n}", markersize=3,
                        linewidth=2 if variant == "retireopd" else 1, label=variant)
        ax.axhline(rows[seed]["S_T"], color="black", linestyle="--", linewidth=1, label="S_T (teacher)")
        if rows[seed]["retired"] is not None:
            ax.axvline(rows[seed]["retired"] - 0.5, color="C0", linestyle=":", linewidth=1, label="retired (rule)")
        ax.set_title(f"seed {seed}", fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("phase-2 iteration", fontsize=8)
    for ax in axes.flat[len(seeds):]:
        ax.axis("off")
    axes[0][0].set_ylabel("student validation success")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle("The kitchen, phase 2 of every --algo: the student's validation (no skills), S_T dashed", fontsize=9)
    fig.tight_layout()
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=100)
    for path in figures:
        write_bytes_atomically(Path(path), picture.getvalue())  # (a new file renamed over it: never through a link)
        print(f"[study] wrote {path}")
    plt.close(fig)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", help="folder of the study's run folders [default: runs/study; with "
                        "--build-teachers: runs/teachers]")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each uses one CPU thread)")
    parser.add_argument("--retire-early", type=int, default=8, help="--retire-at of the early fixed schedule")
    parser.add_argument("--retire-late", type=int, default=40, help="--retire-at of the late fixed schedule")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="run only these (without --teachers retireopd is always run: it trains the teacher)")
    parser.add_argument("--figure", action="append", default=[], help="also write the figure here (repeatable)")
    parser.add_argument("--teachers", help="reuse this study's teachers and base model: phase 2 alone (labs)")
    parser.add_argument("--base-from", help="reuse only this study's base model (phase 1 runs again)")
    parser.add_argument("--script", default=str(HERE / "retireopd.py"),
                        help="the program each run executes: retireopd.py, or a lab's change to it")
    parser.add_argument("--build-teachers", action="store_true",
                        help="train the project's teachers/ again (phase 1 alone of each of --seeds, from tiny_base/) "
                             "and write them there; its runs go to --out")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit("study: --jobs must be >= 1")
    # every path from where the study is started (its runs start in the project's folder)
    out = Path(os.path.abspath(args.out or ("runs/teachers" if args.build_teachers else "runs/study")))
    if args.build_teachers:
        if extra or args.teachers or args.base_from or Path(args.script).resolve() != HERE / "retireopd.py":
            raise SystemExit("study: --build-teachers trains the labs' teachers as the study does: it takes only "
                             "--seeds, --jobs and --out")
        build_teachers(args.seeds, args.jobs, out)
        return {}
    if out.exists() and not out.is_dir():
        raise SystemExit(f"study: --out {args.out or out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    teachers, base_from = (Path(os.path.abspath(p)) if p else None for p in (args.teachers, args.base_from))
    script = Path(args.script).resolve()
    for flag, other in (("--teachers", teachers), ("--base-from", base_from)):
        if other is not None and other.resolve() == out.resolve():
            raise SystemExit(f"study: {flag} must be another study than --out")
    if not script.is_file():
        raise SystemExit(f"study: --script {args.script}: no such file")
    settings = {"retire_early": args.retire_early, "retire_late": args.retire_late, "extra": extra,
                **({"teachers": str(teachers)} if teachers else {}), **({"base_from": str(base_from)} if base_from
                                                                       else {}),
                **({"script": str(script)} if script != HERE / "retireopd.py" else {})}
    saved = out / "study.json"
    before = json.loads(saved.read_text(encoding="utf-8")) if saved.is_file() else {"settings": settings, "wall_s": 0.0}
    if before["settings"] != settings:
        raise SystemExit(f"study: {out} holds a study with other settings ({saved}): choose another --out")
    variants = (["retireopd"] if teachers is None else []) + [v for v in args.variants if v != "retireopd"
                                                              or teachers is not None]
    wall = run_all(args.seeds, out, args.jobs, args.retire_early, args.retire_late, extra, variants, teachers,
                   base_from, script)
    rows = {seed: seed_row(out / f"seed{seed}", teachers / f"seed{seed}" if teachers else None) for seed in args.seeds}
    table = format_table(rows)
    print(table)
    wall += before.get("wall_s", 0.0)  # a study stopped and started again: the wall time of every start
    print(f"[study] {len(args.seeds)} seeds, {args.jobs} runs at a time: {wall:.0f}s of runs in all")
    write_text_atomically(saved, json.dumps({"settings": settings, "rows": {str(k): v for k, v in rows.items()},
                                             "wall_s": round(wall, 1)}, indent=2) + "\n")  # (never through a link)
    write_text_atomically(out / "study.md", table + "\n")
    draw(rows, out, [out / "study.png", *args.figure])
    return rows


if __name__ == "__main__":
    main()
