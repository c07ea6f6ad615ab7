"""checks.py: every bad flag and model source fails in one line before anything is written
(validate_config, saved_settings, model_source_problem: a missing folder, an unknown hub id, no
network, the hub offline), in seconds. (The teacher and run-folder checks are in test_run_folder.py.)"""

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

import bench
import checks
import retireopd as R
from conftest import QUICK, one_line_refusal, save_teacher


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
                           (["--retire-at", "99"], "--retire-at"), (["--temperature", "0.7"], "--temperature"),
                           (["--frozen-dtype", "int8"], "--frozen-dtype"), (["--model", "Qwen2.5-15B"], "alias"),
                           (["--env-workers", "-1"], "--env-workers"),
                           (["--prefill-batch", "-1"], "--prefill-batch"),
                           (["--env", "alfworld", "--alfworld-data", str(tmp_path / "none")], "alfworld-download"),
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


def closed_port_url():
    """An address where nothing listens: connecting is refused at once, like a hub without network."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@contextlib.contextmanager
def stand_in_hub(known=()):
    """A local HTTP server answering the hub's model API: 200 for the repos in `known`, else the
    hub's 404 with X-Error-Code RepoNotFound."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            repo = self.path.split("?")[0].removeprefix("/api/models/")
            body = json.dumps({"id": repo} if repo in known else {"error": "Repository Not Found"}).encode()
            self.send_response(200 if repo in known else 404)
            if repo not in known:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_HEAD = do_GET

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """point(url): this process's Hugging Face hub is at url (None: HF_HUB_OFFLINE), its cache empty."""
    import huggingface_hub
    clear = checks.hub_answer.cache_clear

    def point(url):
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url or "https://huggingface.co")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", url is None)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
        clear()
    yield point
    clear()


def test_model_problems_are_one_line_in_seconds_before_anything_is_written(tmp_path, hub):
    import time as time_module
    run_dir = tmp_path / "run"

    def failure(model, *flags):
        start = time_module.time()
        with pytest.raises(SystemExit) as stop:
            R.main(["--model", model, "--env", "webshop", "--run-dir", str(run_dir), *flags])
        assert time_module.time() - start < 15 and not run_dir.exists()  # (it once retried for 100 s)
        assert "\n" not in str(stop.value.code)
        return str(stop.value.code)
    # a local folder that is not there: said first, even where the environment's data is missing too
    message = failure("./nonexistent_dir", "--env", "alfworld", "--alfworld-data", str(tmp_path / "no-data"))
    assert message.startswith("retireopd: --model ./nonexistent_dir: no such folder")
    assert "tiny" in message and "random:" in message
    assert "has no config.json" in failure(str(tmp_path))
    with stand_in_hub(known={"org/model"}) as url:
        hub(url)
        assert "no model nonexistent/path on the Hugging Face hub" in failure("nonexistent/path")
        assert checks.model_source_problem("org/model") is None  # with network: from_pretrained downloads as usual
    hub(closed_port_url())
    message = failure("Qwen2.5-1.5B")
    assert "cannot reach the Hugging Face hub" in message
    assert "Qwen/Qwen2.5-1.5B-Instruct is not in its cache" in message
    assert "HF_HUB_OFFLINE" in message and "tiny" in message and "local model folder" in message
    hub(None)
    message = failure("Qwen2.5-1.5B")
    assert "is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message


@pytest.mark.slow
def test_hf_hub_offline_is_honoured_and_a_cached_model_loads_while_the_hub_is_unreachable(tiny, tmp_path):
    import subprocess
    import time as time_module
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_CACHE"] = str(tmp_path / "cache")
    start = time_module.time()
    done = subprocess.run([sys.executable, "retireopd.py", "--model", "Qwen2.5-1.5B", "--run-dir", str(tmp_path / "r")],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120,
                          env={**env, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1 and time_module.time() - start < 30 and not (tmp_path / "r").exists()
    assert done.stderr.strip().startswith("retireopd: --model Qwen2.5-1.5B: Qwen/Qwen2.5-1.5B-Instruct is not in "
                                          "the Hugging Face cache") and "\n" not in done.stderr.strip()
    model, tok = tiny  # a model in the hub cache, as a download leaves it
    repo = tmp_path / "cache" / "models--retireopd-test--tiny"
    model.save_pretrained(repo / "snapshots" / ("0" * 40))
    tok.save_pretrained(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    load = ("import time, torch, checks, retireopd as R; start = time.time(); "
            "assert checks.model_source_problem('retireopd-test/tiny') is None; "
            "R.load_policy('retireopd-test/tiny', torch.device('cpu'), torch.float32); print(time.time() - start)")
    done = subprocess.run([sys.executable, "-c", load], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=300, env={**env, "HF_ENDPOINT": closed_port_url()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 15  # from the cache at once, not after the hub's retries
    start = time_module.time()  # --show-prompts reads the cached tokenizer the same way
    done = subprocess.run([sys.executable, "retireopd.py", "--show-prompts", "--model", "retireopd-test/tiny", "--env",
                           "kitchen", "--run-dir", str(tmp_path / "prompts")], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300, env={**env, "HF_ENDPOINT": closed_port_url()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert time_module.time() - start < 30 and "===== teacher" in done.stdout and not (tmp_path / "prompts").exists()


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
