"""Fixtures: tiny models built once per session, an autouse seed, the shared task's prompts."""

from __future__ import annotations

import os

import pytest
import torch

from tests import typechecks

typechecks.install()  # runtime type checks on kvnotes' packages: before anything imports them

from tests.helpers import (  # noqa: E402
    LEARNED_NAMES,
    MODEL_NAMES,
    ROTARY_NAMES,
    WINDOWED,
    Case,
    get_model,
    make_case,
)


def pytest_configure(config):
    # Tiny models: one intra-op thread is fastest, and on a shared 2-core machine extra threads
    # oversubscribe the CPU (a 4 ms forward becomes 300 ms).
    torch.set_num_threads(1)
    # Subprocesses (CLI runs, notebook kernels, servers) get this worker's share of the cores: a
    # child on torch's default of one thread per core, beside the other worker, waits on its
    # OpenMP barriers for a core that is taken (the circuit-report notebook: 19 s alone, 206 s
    # beside one busy core, 19 s there with one thread).
    # Not in xdist's controller: its workers inherit its environment, so a value set there (for one
    # process, all the cores) would be theirs too and the setdefault below would keep it.
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers())))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", params=MODEL_NAMES, ids=MODEL_NAMES)
def model(request):
    """Every tiny model variant (full/partial rotary, GPT-J pairs, GQA, sliding windows, learned
    positions, attention-only, a converted transformers GPT-2)."""
    return get_model(request.param)


@pytest.fixture(scope="session", params=ROTARY_NAMES, ids=ROTARY_NAMES)
def rotary_model(request):
    """The tiny models whose keys carry RoPE: the ones re-rotation and splices can move."""
    return get_model(request.param)


@pytest.fixture(scope="session", params=LEARNED_NAMES, ids=LEARNED_NAMES)
def learned_model(request):
    """The tiny models with learned absolute positions (tiny-attn-only, tiny-gpt2)."""
    return get_model(request.param)


@pytest.fixture(scope="session", params=WINDOWED, ids=WINDOWED)
def windowed_model(request):
    """The tiny models with sliding-window local layers."""
    return get_model(request.param)


@pytest.fixture(scope="session")
def gemma3():
    """tiny-gemma3: per-layer RoPE bases, sliding windows, one KV head — the hardest variant."""
    return get_model("tiny-gemma3")


@pytest.fixture(scope="session")
def case(model) -> Case:
    return make_case(model)


@pytest.fixture(scope="session")
def rotary_case(rotary_model) -> Case:
    return make_case(rotary_model)


@pytest.fixture(scope="session")
def gcase(gemma3) -> Case:
    return make_case(gemma3)


# --- the model organisms (trained on a cold cache, ~15 s each, then loaded from it) -----------
@pytest.fixture(scope="session")
def notes_organism():
    """notes-organism: every layer local (window 8); its decision can only read notes."""
    from kvnotes.zoo.organisms import load_organism

    return load_organism("notes-organism")


@pytest.fixture(scope="session")
def lookup_organism():
    """lookup-organism: one global layer; its decision must read the field's own slot."""
    from kvnotes.zoo.organisms import load_organism

    return load_organism("lookup-organism")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # pytest-randomly shuffles every run; its header line is hidden under -q, so say the seed last
    seed = config.getoption("randomly_seed", default=None)
    if seed is not None and config.getoption("randomly_reorganize", default=False):
        terminalreporter.write_line(
            f"random test order, seed {seed}: replay it with `python -m pytest -q --randomly-seed={seed}`"
        )


def pytest_collection_modifyitems(session, config, items):
    # The real-server test first: on two workers it then serves (vLLM on one core, the client
    # waiting) while the other worker runs the rest, instead of running alone at the end.
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/serving/test_vllm.py")


def _workers() -> int:
    """How many pytest-xdist workers share this machine (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M, with this worker's share of the cores while a module uses it (one real model);
    more threads than cores would make both workers spin."""
    from kvnotes.zoo import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers()))
    yield load_model("gemma-3-270m")
    torch.set_num_threads(threads)
