"""What a run shows a person: the live dashboard (--report-to tensorboard | wandb), the summary line
printed at the end, and the plot (RUN_DIR/plot.png, --plot, --compare). They read the run folder's
logs; their heavy packages (TensorBoard, W&B, matplotlib) are imported only here, and only when asked
for. A leaf beside the method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Optional

from common import PHASES, make_fresh, read_jsonl, read_owned_text, write_bytes_atomically

# ==================================================================================================
# The live dashboard (--report-to tensorboard | wandb)
# ==================================================================================================


def tracker_step(steps_before: dict, phase: str, iteration: int) -> int:
    """A tracker's step: the updates done so far, phase 1's then phase 2's (one axis, as the plot draws
    them); steps_before: {phase: the iterations run before it} (retireopd.py's steps_before_phases).
    Iteration i ends at step i + 1, so a validation before training (iteration -1) is step 0, as in
    verl's val_before_train; trackers take no negative step (W&B drops it)."""
    return steps_before[phase] + iteration + 1


def flat_numbers(record: dict, prefix: str) -> dict:
    """{prefix/key: number} for every number of a record (booleans 0/1; nested dicts flattened with "/";
    strings and None left out)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}/{key}"))
        elif isinstance(value, (bool, int, float)):
            out[f"{prefix}/{key}"] = float(value)
    return out


def tracker_record(steps_before: dict, name: str, record: dict) -> Optional[tuple[int, dict]]:
    """What a tracker gets from one line of the run folder's logs: (step, {key: number}), or None.
    metrics.jsonl: PHASE/KEY for each number of the line; eval.jsonl: PHASE/PANEL_skills/KEY (or
    _no_skills); events.jsonl: the retirement alone, student/retirement/KEY. The phase, iteration,
    panel and skills of a line (and before_training: step 0) make its key and step, not values."""
    if name == "metrics.jsonl":
        phase, iteration, prefix = record["phase"], record["iteration"], record["phase"]
    elif name == "eval.jsonl":
        phase, iteration = record["phase"], record["iteration"]
        prefix = f"{phase}/{record['panel']}_{'skills' if record.get('skills') else 'no_skills'}"
    elif name == "events.jsonl" and record.get("event") == "retirement":
        phase, iteration, prefix = "student", record["decided_after_iteration"], "student/retirement"
    else:
        return None
    keys = {"phase", "iteration", "panel", "skills", "before_training", "event", "decided_after_iteration"}
    values = flat_numbers({k: v for k, v in record.items() if k not in keys}, prefix)
    return tracker_step(steps_before, phase, iteration), values


class Tracker:
    """--report-to: a live dashboard beside the jsonl logs, on rank 0 (main starts it, Run.log feeds it).

    tensorboard: event files in RUN_DIR/tensorboard; a resume appends there and purges the steps it
    redoes. wandb: one W&B run whose id is the run's run_id (run.json), so a resume continues it
    (W&B keeps the values it already has for the redone steps); project $WANDB_PROJECT or
    "retireopd", its files in $WANDB_DIR or the run folder. Each package is imported only here."""

    @staticmethod
    def problem(report_to: str) -> Optional[str]:
        """Why --report-to cannot run here, in one line (its package is missing), or None."""
        try:
            if report_to == "tensorboard":
                import torch.utils.tensorboard  # noqa: F401 (it needs the tensorboard package)
            elif report_to == "wandb":
                import wandb  # noqa: F401
        except ImportError:
            return f"--report-to {report_to} needs the {report_to} package, not installed here: pip install {report_to}"
        return None

    def __init__(self, cfg, run_dir: Path, run_id: str, steps_before: dict, purge_step: Optional[int] = None):
        self.cfg, self.steps_before = cfg, steps_before
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            try:  # (its event files have predictable names: written in a folder no one else can add to)
                make_fresh(run_dir / "tensorboard", run_dir)
            except OSError as error:
                raise SystemExit(f"retireopd: {error.filename} is {error.strerror}, inside the run's tensorboard/: a "
                                 "run folder's own entries must be plain files (a link could make the run write "
                                 "outside it); remove it, then try again") from None
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)
        else:
            import wandb
            settings = dict(project=os.environ.get("WANDB_PROJECT") or "retireopd", name=run_dir.name, id=run_id,
                            resume="allow", config=dataclasses.asdict(cfg),
                            dir=None if os.environ.get("WANDB_DIR") else str(run_dir))
            try:
                self.writer = wandb.init(**settings)
            except wandb.errors.UsageError as error:  # no login here (no API key): log offline, sync later
                print(f"[retireopd] note: W&B cannot log online ({str(error).strip().splitlines()[0]}): logging "
                      "offline instead; `wandb sync` uploads the run later, from its wandb/ folder")
                self.writer = wandb.init(**settings, mode="offline")

    def log(self, name: str, record: dict) -> None:
        found = tracker_record(self.steps_before, name, record)
        if found is None:
            return
        step, values = found
        if self.cfg.report_to == "wandb":
            self.writer.log(values, step=step)
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # (once per iteration: a crash loses nothing that metrics.jsonl has)

    def close(self) -> None:
        if self.cfg.report_to == "wandb":
            self.writer.finish()
        else:
            self.writer.close()


# ==================================================================================================
# A finished run: its summary line, its plot (RUN_DIR/plot.png, --plot), several runs on one figure (--compare)
# ==================================================================================================


def run_summary(run_dir: Path) -> str:
    """The end-of-run summary, from the run folder's logs: S_T, when the teacher retired, and the
    report panel's success of the teacher (with skills, and without for skill-grpo) and the student."""
    events = read_jsonl(run_dir / "events.jsonl")
    reports = {(e["phase"], e["skills"]): e["overall"] for e in read_jsonl(run_dir / "eval.jsonl")
               if e.get("panel") == "report"}
    saved = {}
    for phase in PHASES:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((run_dir / phase / "retireopd.json").read_text(encoding="utf-8"))
            saved[phase] = record if isinstance(record, dict) else {}
    teacher_success = saved.get("student", saved.get("teacher", {})).get("teacher_success")
    parts = [f"S_T {teacher_success:.3f}"] if isinstance(teacher_success, (int, float)) else []
    retirements = [e for e in events if e["event"] == "retirement"]
    if retirements:
        parts.append(f"teacher retired from student iteration {retirements[-1]['retired_at']} "
                     f"({retirements[-1]['rule']} rule)")
    elif "student" in saved and saved["student"].get("teacher_success") is not None:
        parts.append("teacher never retired")
    names = {("teacher", True): "teacher with skills", ("teacher", False): "teacher without skills",
             ("student", False): "student"}
    panel = [f"{names[key]} {reports[key]:.2f}" for key in names if key in reports]
    if panel:
        parts.append("report panel: " + ", ".join(panel))
    return "; ".join(parts)


def plot_runs(run_dirs: list, out: Optional[Path] = None) -> Optional[Path]:
    """One PNG for one or more runs. Top: success (thin lines: training episodes; dots: the
    validation panel), the competence bar rho * S_T, the retirement. Bottom: the gap K per
    phase-2 iteration, its block means (what the rule compares) and the k3 diagnostic.

    matplotlib is optional: without it we say how to get the plot and return None.
    """
    missing = [str(d) for d in run_dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        raise SystemExit(f"retireopd: no metrics.jsonl in {', '.join(missing)}: not a run folder")
    configs = [json.loads(read_owned_text(Path(d) / "config.json")) for d in run_dirs]
    envs = sorted({c["env"] for c in configs})
    title = (f"{configs[0]['algo']} on {configs[0]['env']} with {configs[0]['model']}" if len(run_dirs) == 1
             else f"{len(run_dirs)} runs on {' and '.join(envs)}")
    all_metrics = [read_jsonl(Path(d) / "metrics.jsonl") for d in run_dirs]
    # phase 2 is drawn after phase 1 on one iteration axis: every run's phase 2 starts at the same
    # place (a --algo grpo run, which has no phase 1, beside a RetireOPD student)
    offset = max(sum(m["phase"] == "teacher" for m in metrics) for metrics in all_metrics)
    try:  # (the logs are read first: logs that are not a run's are an error with or without matplotlib)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[retireopd] no plot: `pip install matplotlib`, then `python retireopd.py --plot RUN_DIR`")
        return None
    fig, (ax_success, ax_gap) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    fig.suptitle(title, fontsize=10)
    for n, (run_dir, metrics) in enumerate(zip(map(Path, run_dirs), all_metrics)):
        color = f"C{n}"
        label = run_dir.name if len(run_dirs) > 1 else "student"
        teacher = [m for m in metrics if m["phase"] == "teacher"]
        student = [m for m in metrics if m["phase"] == "student"]
        before = {(e["phase"], e["skills"]): e["overall"] for e in read_jsonl(run_dir / "eval.jsonl")
                  if e.get("before_training")}  # the validation before a phase's first update (iteration -1)
        if teacher:
            ax_success.plot([m["iteration"] for m in teacher], [m["success"] for m in teacher], color="gray",
                            alpha=0.35, linewidth=1)  # (phase 1 as long as this run's: another's may be longer)
            val = [(-1, before[("teacher", True)])] if ("teacher", True) in before else []
            val += [(m["iteration"], m["val_success"]) for m in teacher if "val_success" in m]
            ax_success.plot(*zip(*val), "o-", color="gray", markersize=4,
                            label="teacher, with skills (phase 1)" if n == 0 else None)
            for ax in (ax_success, ax_gap):
                ax.axvline(offset - 0.5, color="black", linewidth=0.8, alpha=0.3)
        ax_success.plot([offset + m["iteration"] for m in student], [m["success"] for m in student],
                        color=color, alpha=0.35, linewidth=1)
        val = [(offset - 1, before[("student", False)])] if ("student", False) in before else []
        val += [(offset + m["iteration"], m["val_success"]) for m in student if "val_success" in m]
        if val:
            ax_success.plot(*zip(*val), "o-", color=color, markersize=4, label=f"{label}, no skills (phase 2)")
        bar = [m["teacher_success"] for m in student if m.get("teacher_success")]
        if bar:
            ax_success.axhline(configs[n]["rho"] * bar[0], color=color, linestyle=":", linewidth=1,
                               label="competence bar rho * S_T" if n == 0 else None)
        with_gap = [m for m in student if "gap" in m]  # none without a teacher in phase 2
        ax_gap.plot([offset + m["iteration"] for m in with_gap], [m["gap"] for m in with_gap], color=color,
                    alpha=0.4, linewidth=1, label=None if not with_gap else f"{label}: K" if len(run_dirs) > 1
                    else "K per iteration")
        ax_gap.plot([offset + m["iteration"] for m in with_gap], [m["gap_k3"] for m in with_gap], color=color,
                    linestyle="--", alpha=0.4, linewidth=1, label=None if len(run_dirs) > 1 else "k3 diagnostic")
        window = configs[n]["window"]
        blocks = [m for m in with_gap if "gap_block" in m]
        for k, m in enumerate(blocks):
            ax_gap.hlines(m["gap_block"], offset + m["iteration"] - window + 0.5, offset + m["iteration"] + 0.5,
                          color=color, linewidth=2.5,
                          label=(f"{label}: block means" if len(run_dirs) > 1 else f"block means of K (W = {window})")
                          if k == 0 else None)
        for event in read_jsonl(run_dir / "events.jsonl"):
            if event.get("event") == "retirement":
                for ax in (ax_success, ax_gap):
                    ax.axvline(offset + event["retired_at"] - 0.5, color=color, linestyle="--")
                ax_gap.annotate("teacher retired", (offset + event["retired_at"] - 0.5, 0), color=color,
                                xycoords=("data", "axes fraction"), xytext=(3, 5), textcoords="offset points")
    ax_success.set_ylim(-0.03, 1.03)
    ax_success.set_ylabel("success (thin: training,\ndots: validation panel)")
    ax_success.legend(fontsize=8)
    ax_gap.set_ylabel("teacher-student gap\n(phase 2, while the teacher scores)")
    ax_gap.set_xlabel("iteration (phase 1, then phase 2)")
    ax_gap.xaxis.get_major_locator().set_params(integer=True)
    ax_gap.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out or Path(run_dirs[0]) / ("compare.png" if len(run_dirs) > 1 else "plot.png"))
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format="png")
    plt.close(fig)
    write_bytes_atomically(out, image.getvalue())  # (never through a link planted at out)
    return out
