"""model_sources.py: every bad model source fails in one line before anything is written
(model_source_problem: a missing folder, an unknown hub id, no network, the hub offline), in seconds, and a
cached hub model loads at once while the hub is unreachable. (The teacher checks are in
test_run_folder.py.)"""

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

import model_sources
import retireopd as R


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
    clear = model_sources.hub_answer.cache_clear

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
        # with network: from_pretrained downloads as usual
        assert model_sources.model_source_problem("org/model") is None
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
    load = ("import time, torch, model_sources, retireopd as R; start = time.time(); "
            "assert model_sources.model_source_problem('retireopd-test/tiny') is None; "
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
