"""What serves other needs than training: the memory estimate printed before each phase, the live
dashboards (--report-to), the plot (--plot, --compare, and the one drawn at the end of a run) and the
built-in benchmark (--benchmark). Their heavy packages (matplotlib, TensorBoard, W&B) are imported
only here, and only when asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Optional

import torch

import multigpu
import retireopd as R


# ==================================================================================================
# The memory estimate, printed (and logged) before each phase
# ==================================================================================================


def estimate_memory_gb(model, cfg: R.Config, n_frozen: int, skill_tokens: int = 0,
                       device: Optional[torch.device] = None, processes: Optional[int] = None) -> dict:
    """Rough start-up estimate of a phase's peak accelerator memory, printed before it runs (GiB),
    per process: `processes` ranks under torchrun (default: this run's, world_size()).

    Always resident: the trained policy's fp32 master weights + fp32 gradient + two fp32 AdamW
    moments (16 B/param), plus autocast's bf16 copy of the weights (2 B/param); the frozen
    teacher/reference, 4 or 2 B/param (--frozen-dtype). On top of that, the largest of three
    stages that never overlap (each frees its tensors before the next begins):
      rollout: the KV cache of the lock-step batch at full length (keys fp32 under autocast,
        values bf16; plus one layer, the copy each decode step's concatenation makes); the
        prefill's temporaries, for prefill_batch rows (all B*G when 0) of the widest prompt:
        one layer's working set per token (fp32 residual stream, its norm and the attention
        output, 12 B per hidden unit; three bf16 MLP tensors, 6 B per intermediate unit) and
        the boolean attention mask (width^2 B per row); sampling: three fp32 (B*G, vocab)
        tensors per decode step (generate's logits and softmax, our log-softmax).
      forward/backward: with gradient checkpointing one fp32 hidden state per layer per token
        of a micro-batch plus one layer's working set; log-probs: one chunk of
        vocabulary-sized fp32 logits and their softmax.
      optimizer step: AdamW's temporaries: none when fused (CUDA), about one fp32 copy of the
        parameters for the multi-tensor path (not used), two of the largest parameter's size for
        the CPU loop.
    With N > 1 processes (FSDP2): the 16 B/param and the frozen models are divided by N, and
    autocast keeps no weight copy (its cache is off: the bf16 casts live one layer at a time; without
    gradient checkpointing backward keeps every layer's, 2 B/param);
    each rank plays B*G/N episodes; and two parts are whole on every rank: the sampling copy of
    the policy (sampling_model: 2 B per Linear weight and 4 B per other weight on a GPU, 4 B on
    CPU) and, during a forward or backward, the gathered weights and gradients (fp32) of two
    decoder layers (the one computing and the one prefetched) and of the root (embeddings, lm_head).
    device: where the run trains (default: the model's), which decides the AdamW path.
    """
    device = device or next(model.parameters()).device
    processes = processes or multigpu.world_size()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    shape = model.config
    hidden, intermediate, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    frozen_bytes = 2 if cfg.frozen_dtype == "bfloat16" else 4
    per_layer_token = hidden * 4 * (1 if cfg.gradient_checkpointing else 24)
    activations = cfg.token_budget * (per_layer_token * layers + 6 * intermediate * 2)
    sequences = cfg.batch_tasks * cfg.group_size // processes
    head_dim = hidden // shape.num_attention_heads
    prompt_width = cfg.max_prompt_tokens + skill_tokens
    kv_cache = (sequences * (prompt_width + cfg.max_response_tokens) * (layers + 1)
                * shape.num_key_value_heads * head_dim * (4 + 2))
    prefill_rows = min(cfg.prefill_batch or sequences, sequences)
    prefill = prefill_rows * prompt_width * (12 * hidden + 6 * intermediate + prompt_width)
    largest = max(p.numel() for p in params) // processes
    if device.type == "cuda":  # build_adamw: fused on CUDA
        optimizer_temporaries = 0
    else:  # torch's per-parameter loop on CPU: sqrt(v) and its quotient, for the largest parameter
        optimizer_temporaries = 2 * 4 * largest
    sampling_copy = gathered = 0
    if processes > 1:
        head = model.get_output_embeddings()
        linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
                     for p in m.parameters())
        sampling_copy = 2 * linear + 4 * (n_params - linear) if device.type == "cuda" else 4 * n_params
        layer = sum(p.numel() for p in model.base_model.layers[0].parameters())
        gathered = 8 * (2 * layer + n_params - layers * layer)
    bf16_casts = 0 if cfg.gradient_checkpointing else 2 * n_params  # (sharded: kept for backward, whole)
    parts = dict(policy_and_adam=(18 * n_params if processes == 1 else 16 * n_params / processes + bf16_casts),
                 frozen_models=frozen_bytes * n_params * n_frozen / processes, sampling_copy=sampling_copy,
                 kv_cache=kv_cache, prefill=prefill, sampling=3 * sequences * shape.vocab_size * 4,
                 activations=activations, logits=cfg.logprob_chunk * shape.vocab_size * 12, gathered=gathered,
                 optimizer_temporaries=optimizer_temporaries)
    gib = {k: round(v / 2**30, 2) for k, v in parts.items()}
    stages = {"rollout": gib["kv_cache"] + gib["prefill"] + gib["sampling"],
              "forward_backward": gib["activations"] + gib["logits"] + gib["gathered"],
              "optimizer_step": gib["optimizer_temporaries"]}
    gib["peak_stage"] = max(stages, key=stages.get)
    resident = gib["policy_and_adam"] + gib["frozen_models"] + gib["sampling_copy"]
    gib["total"] = round(resident + stages[gib["peak_stage"]], 2)
    gib["params_millions"] = round(n_params / 1e6, 2)
    gib["processes"] = processes
    return gib


def format_memory_estimate(memory: dict) -> str:
    """One line: the total, what stays resident, and each stage with its parts (the largest first)."""
    stages = {"rollout": ("kv_cache", "prefill", "sampling"),
              "forward_backward": ("activations", "logits", "gathered"), "optimizer_step": ("optimizer_temporaries",)}
    order = sorted(stages, key=lambda stage: stage != memory["peak_stage"])
    described = [f"{stage}: " + " + ".join(f"{part} {memory[part]}" for part in stages[stage]
                                           if part != "gathered" or memory[part]) for stage in order]
    copy = f" + sampling_copy {memory['sampling_copy']}" if memory["sampling_copy"] else ""
    per_rank = f" per process of {memory['processes']}" if memory["processes"] > 1 else ""
    return (f"{memory['total']} GiB{per_rank} = policy_and_adam {memory['policy_and_adam']} + frozen_models "
            f"{memory['frozen_models']}{copy} + the largest stage ({'; '.join(described)}); "
            f"{memory['params_millions']}M parameters")


def print_memory_estimate(policy, cfg: R.Config, run: R.Run, phase: str, frozen: R.FrozenModels,
                          skill_tokens: int = 0) -> None:
    """Print (and log) the memory estimate before the phase allocates anything heavy."""
    device = next(policy.parameters()).device
    n_frozen = sum(model is not None for model in (frozen.teacher, frozen.reference))
    memory = estimate_memory_gb(policy, cfg, n_frozen, skill_tokens, device)
    print(f"[retireopd] {phase} memory estimate: {format_memory_estimate(memory)}")
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory / 2**30
        if memory["total"] > 0.95 * available:
            print(f"[retireopd] WARNING: the estimate exceeds this GPU's {available:.0f} GiB: lower "
                  "--token-budget, --max-prompt-tokens or --batch-tasks, or set --kl-coef 0")
    run.log("events.jsonl", {"event": "memory_estimate", "phase": phase, "gib": memory, "device": str(device)})

# ==================================================================================================
# The live dashboard (--report-to tensorboard | wandb)
# ==================================================================================================


def tracker_step(cfg: R.Config, phase: str, iteration: int) -> int:
    """A tracker's step: the updates done so far, phase 1's then phase 2's (one axis, as the plot draws
    them). Iteration i ends at step i + 1, so a validation before training (iteration -1) is step 0, as
    in verl's val_before_train; trackers take no negative step (W&B drops it)."""
    offset = R.phase_iterations(cfg, "teacher") if phase == "student" and R.ALGORITHMS[cfg.algo].teacher_phase else 0
    return offset + iteration + 1


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


def tracker_record(cfg: R.Config, name: str, record: dict) -> Optional[tuple[int, dict]]:
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
    return tracker_step(cfg, phase, iteration), flat_numbers({k: v for k, v in record.items() if k not in keys}, prefix)


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

    def __init__(self, cfg: R.Config, run_dir: Path, run_id: str, purge_step: Optional[int] = None):
        self.cfg = cfg
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)
        else:
            import wandb
            self.writer = wandb.init(project=os.environ.get("WANDB_PROJECT") or "retireopd", name=run_dir.name,
                                     id=run_id, resume="allow", config=dataclasses.asdict(cfg),
                                     dir=None if os.environ.get("WANDB_DIR") else str(run_dir))

    def log(self, name: str, record: dict) -> None:
        found = tracker_record(self.cfg, name, record)
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
    events = R.read_jsonl(run_dir / "events.jsonl")
    reports = {(e["phase"], e["skills"]): e["overall"] for e in R.read_jsonl(run_dir / "eval.jsonl")
               if e.get("panel") == "report"}
    saved = {}
    for phase in R.PHASES:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((run_dir / phase / "retireopd.json").read_text())
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
    configs = [json.loads((Path(d) / "config.json").read_text()) for d in run_dirs]
    envs = sorted({c["env"] for c in configs})
    title = (f"{configs[0]['algo']} on {configs[0]['env']} with {configs[0]['model']}" if len(run_dirs) == 1
             else f"{len(run_dirs)} runs on {' and '.join(envs)}")
    all_metrics = [R.read_jsonl(Path(d) / "metrics.jsonl") for d in run_dirs]
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
        before = {(e["phase"], e["skills"]): e["overall"] for e in R.read_jsonl(run_dir / "eval.jsonl")
                  if e.get("before_training")}  # the validation before a phase's first update (iteration -1)
        if teacher:
            ax_success.plot(range(offset), [m["success"] for m in teacher], color="gray", alpha=0.35, linewidth=1)
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
        for event in R.read_jsonl(run_dir / "events.jsonl"):
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
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

# ==================================================================================================
# The built-in benchmark (--benchmark): our code paths against the plain Hugging Face ones
# ==================================================================================================


MEASURABLE_PEAK_GB = 0.01  # the benchmark's memory floor: below it a peak is noise, not a measurement


def benchmark(cfg: R.Config, repeats: int = 3) -> dict:
    """Time our rollout generation, update and log-probs against the plain Hugging Face calls on
    the same inputs (interleaved repetitions, medians), with peak memory for the log-probs.

    Ratios > 1 mean ours is faster (time) / leaner (memory is ours / plain: < 1 is leaner).
    """
    import statistics
    device = R.pick_device(cfg.device)
    model, tokenizer = R.load_policy(cfg.model, device, torch.float32, cfg.seed)
    if cfg.gradient_checkpointing and device.type == "cuda":
        model.activation_checkpointing_enable()
    rng = random.Random(cfg.seed)
    words = ["go to cabinet", "open drawer", "take mug", "click[b0fsh00001]", "search[red shoes]"]
    prompts = [R.encode_prompt(tokenizer, R.build_user_message(
        "alfworld", "put a clean mug in the coffeemachine", 0, [], "You arrive at countertop 1. " * rng.randint(2, 20),
        [f"{rng.choice(words)} {k}" for k in range(rng.randint(5, 40))]))
        for _ in range(cfg.batch_tasks * cfg.group_size)]
    n_new = cfg.max_response_tokens
    samples = [R.TurnSample(0, i, p, [rng.randrange(len(tokenizer)) for _ in range(n_new)], False)
               for i, p in enumerate(prompts)]
    timings: dict = {name: [] for name in ("ours_generate", "plain_generate", "ours_update",
                                           "plain_update", "ours_logprob", "plain_logprob")}
    memory = {"ours_logprob": [], "plain_logprob": []}
    optimizer = R.build_adamw(model, dataclasses.replace(cfg, lr=0.0))  # lr 0: measure without moving

    def plain_generate():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        with R.autocast(device):
            out = model.generate(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                                 do_sample=True, max_new_tokens=n_new, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id)
        return int((out[:, width:] != tokenizer.pad_token_id).sum())

    def plain_batch():
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), tokenizer.pad_token_id, device=device)
        for b, s in enumerate(samples):
            ids[b, : len(s.prompt_ids) + n_new] = torch.tensor(s.prompt_ids + s.response_ids)
        return ids, (ids != tokenizer.pad_token_id).long()

    def plain_logprobs(ids, mask):  # the naive path: full (batch, seq, vocab) float32 log-softmax
        with R.autocast(device):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)

    def plain_update():
        model.train()
        ids, mask = plain_batch()
        logp = plain_logprobs(ids, mask)
        (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(mask.sum())

    def time_stage(name, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings[name].append((time.perf_counter() - start, result))

    old = [torch.zeros(n_new) for _ in samples]
    advantages = [torch.ones(n_new) for _ in samples]
    for _ in range(repeats):
        model.eval()
        time_stage("ours_generate", lambda: sum(len(r.ids) for r in R.generate(model, tokenizer, prompts, n_new, 1.0,
                                                                              prefill_batch=cfg.prefill_batch)))
        time_stage("plain_generate", plain_generate)
        time_stage("ours_update", lambda: R.ppo_update(model, optimizer, samples, old, advantages, cfg,
                                                     mini_batch=cfg.mini_batch)["trained_tokens"])
        time_stage("plain_update", plain_update)
        for name, fn in (("ours_logprob", lambda: R.response_logprobs(model, samples, cfg)),
                         ("plain_logprob", lambda: plain_logprobs(*plain_batch()))):
            gc.collect()
            base = R.current_memory_gb(device)
            R.reset_peak_memory(device)
            with torch.no_grad():
                time_stage(name, lambda: (fn(), len(samples) * n_new)[1])
            memory[name].append(R.peak_memory_gb(device) - base)
    median = {name: statistics.median(t for t, _ in runs) for name, runs in timings.items()}
    peak = {name: statistics.median(v) for name, v in memory.items()}
    tokens = {name: runs[-1][1] for name, runs in timings.items()}
    per_s = {name: tokens[name] / median[name] for name in median}
    report = {
        "model": cfg.model, "device": str(device), "sequences": len(prompts), "new_tokens": n_new,
        "tokens_per_s": {k: round(v, 1) for k, v in per_s.items()},
        "rollout_speed_ratio": round(per_s["ours_generate"] / per_s["plain_generate"], 3),
        "update_speed_ratio": round(per_s["ours_update"] / per_s["plain_update"], 3),
        "logprob_speed_ratio": round(median["plain_logprob"] / median["ours_logprob"], 3),
        "logprob_peak_gb": {k: round(v, 4) for k, v in peak.items()},
        # a ratio of two peaks near the measurement's noise (CPU resident-set changes) means
        # nothing, and can even be negative: none below the floor
        "logprob_memory_ratio": round(peak["ours_logprob"] / peak["plain_logprob"], 4)
        if min(peak.values()) >= MEASURABLE_PEAK_GB else None,
    }
    return report


def print_benchmark(report: dict, run_dir: Path) -> None:
    """Print the benchmark's table (tokens/s, medians) and write its report to RUN_DIR/benchmark.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    speed = report["tokens_per_s"]
    print(f"benchmark of {report['model']} on {report['device']} (tokens/s, medians; "
          f"also in {run_dir / 'benchmark.json'})\n"
          f"  {'stage':<10}{'ours':>12}{'plain':>12}{'ours/plain':>12}")
    for stage, ratio in (("generate", "rollout_speed_ratio"), ("update", "update_speed_ratio"),
                         ("logprob", "logprob_speed_ratio")):
        print(f"  {stage:<10}{speed['ours_' + stage]:>12.0f}{speed['plain_' + stage]:>12.0f}"
              f"{report[ratio]:>12.2f}")
    peak, ratio = report["logprob_peak_gb"], report["logprob_memory_ratio"]
    print(f"  log-prob peak memory (GiB): ours {peak['ours_logprob']}, plain {peak['plain_logprob']}, "
          + (f"ratio {ratio}" if ratio is not None else
             f"no ratio: a peak below {MEASURABLE_PEAK_GB} GiB is too small to measure (use a model with "
             "the real vocabulary, e.g. random:small-vocab151k)"))
