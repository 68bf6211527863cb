"""Fixtures: tiny models built once per session, an autouse seed, the shared task's prompts."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import MODEL_NAMES, WINDOWED, Case, get_model, make_case


def pytest_configure(config):
    # Tiny models: one intra-op thread is fastest, and on a shared 2-core machine extra threads
    # oversubscribe the CPU (a 4 ms forward becomes 300 ms).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", params=MODEL_NAMES, ids=MODEL_NAMES)
def model(request):
    """Every tiny model variant (full/partial rotary, GPT-J pairs, GQA, sliding windows, ...)."""
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
def gcase(gemma3) -> Case:
    return make_case(gemma3)


# --- the model organisms (trained on a cold cache, ~15 s each, then loaded from it) -----------
@pytest.fixture(scope="session")
def notes_organism():
    """notes-organism: every layer local (window 8); its decision can only read notes."""
    from kvnotes.models.organisms import load_organism

    return load_organism("notes-organism")


@pytest.fixture(scope="session")
def lookup_organism():
    """lookup-organism: one global layer; its decision must read the field's own slot."""
    from kvnotes.models.organisms import load_organism

    return load_organism("lookup-organism")


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M, with every core while a module uses it (one real model)."""
    from kvnotes.models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield load_model("gemma-3-270m")
    torch.set_num_threads(threads)
