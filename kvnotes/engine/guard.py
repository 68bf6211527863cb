"""`guard(model)`: every tensor an operation makes stays on the model's device and in its dtype, or
the operation stops, naming the torch call and where in kvnotes it was made.

    with guard(model):  # or guard(model, device=..., dtype=...) for an explicit pair
        result = field_refresh(model, pairs)

Under the guard every torch call (a `torch.overrides.TorchFunctionMode`: factory functions,
arithmetic, `.to`, modules' own calls) is checked as it returns. A call fails the guard when it
*makes* a misplaced tensor:

- a floating tensor in a dtype that none of its floating inputs had and that is neither the
  model's dtype nor allowed where it is made (`allow`): `torch.zeros(n)` (float32) beside a
  bfloat16 model, `x.double()`, `x.float()`; arithmetic that carries a dtype it was given (a
  float64 metric minus a float64 metric) is not a new one;
- a tensor on a device that none of its inputs was on and that is not the model's:
  `x.to("meta")`, `torch.zeros(n, dtype=model.dtype)` beside a CUDA model. Integer and boolean
  tensors may live on the CPU: a notebook keeps its positions and tokens there (host-side
  indices, read by Python without a device sync), and the engine moves an index to the device
  where it meets keys and values;
- with `factories=True` (the default), a floating tensor made on the host: by a factory called
  without `device=` (`torch.zeros(n)`, `torch.tensor(floats)`), or from such tensors only (a
  cast of an index made so, `one_hot(torch.tensor(groups)).double()`). On the CPU it lands on
  the model's device by luck, on a GPU it would stay on the CPU, so this catches on the CPU what
  would fail on CUDA.

What the model's own libraries do inside is theirs (`LIBRARIES`: TransformerLens's and
transformers' norms compute bfloat16 inputs in float32 and cast back, sae-lens builds an SAE on the
meta device first); the rules apply to calls made anywhere else: kvnotes, probes, circuits and the
user's own code under the guard.

What leaves the device on purpose is allowed: `.cpu()`, `.numpy()`, `.tolist()`, `.item()` and
Python's `float()`/`int()`/`bool()` of a tensor, the results' way out at the end. Code that means to
compute in another dtype says so where it does (`allow`): the metrics read decisions in float64
(`kvnotes.metrics`: two logits per prompt, so margins are not rounded to bfloat16's 8 bits).

The first violation raises `PlacementError`; a violation that code under the guard catches is
raised again when the guard exits, so none is lost.
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode

from kvnotes.engine.profile import wraps_calls
from kvnotes.models.placement import same_device

EXITS = frozenset({"cpu", "numpy", "tolist", "item", "__float__", "__int__", "__bool__", "__index__"})
PROJECT = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("kvnotes", "probes", "circuits"))
_ALLOWED: contextvars.ContextVar[frozenset[torch.dtype]] = contextvars.ContextVar(
    "kvnotes_guard_allowed", default=frozenset()
)


class PlacementError(RuntimeError):
    """A tensor made on another device or in another dtype than the model's, under `guard`."""


@contextmanager
def allow(*dtypes: torch.dtype) -> Iterator[None]:
    """Tensors of `dtypes` may be made inside this block (on the model's device still): the one
    way code under `guard` computes in another precision on purpose. Costs nothing unguarded.

    >>> with allow(torch.float64):
    ...     torch.zeros(1, dtype=torch.float64).dtype
    torch.float64
    """
    token = _ALLOWED.set(_ALLOWED.get() | frozenset(dtypes))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


class _Guard(TorchFunctionMode):
    def __init__(self, device: torch.device, dtype: torch.dtype, factories: bool, collect: bool) -> None:
        super().__init__()
        self.device, self.dtype, self.factories, self.collect = device, dtype, factories, collect
        self.violations: list[str] = []
        self.host: dict[int, weakref.ref] = {}  # id -> the tensors `_on_host` made (by identity)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in EXITS or name == "__get__":
            return out
        problem = self._problem(name, out, args, kwargs)
        if problem:
            self.violations.append(f"{problem} ({_where()})")
            if not self.collect:
                raise PlacementError(self.violations[-1])
        return out

    def _problem(self, name: str, out, args, kwargs) -> str | None:
        made = [t for t in _tensors(out) if isinstance(t, torch.Tensor)]
        if not made or _caller() in LIBRARIES:  # the model's own libraries run as they do
            return None
        given = [t for t in _tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
        floats = [t for t in given if t.is_floating_point()]
        for t in made:
            # a float's place is the model's device (or one a float it came from was already on);
            # an integer or boolean index may also live on the CPU
            prior = {u.device for u in (floats if t.is_floating_point() else given)}
            host_index = t.device.type == "cpu" and not t.is_floating_point()
            if not same_device(t.device, self.device) and t.device not in prior and not host_index:
                return f"torch {name} made a tensor on {t.device}; the model is on {self.device}"
        dtypes = {t.dtype for t in floats} | {self.dtype} | _ALLOWED.get()
        for t in made:
            if t.is_floating_point() and t.dtype not in dtypes:
                return f"torch {name} made a {t.dtype} tensor; the model computes in {self.dtype}"
        if self.factories and self._on_host(made, given, args, kwargs):
            if any(t.is_floating_point() for t in made):
                return (
                    f"torch {name} made a floating tensor on the host without device= "
                    "(on a GPU it would be on the CPU, not with the model)"
                )
        return None

    def _on_host(self, made, given, args, kwargs) -> bool:
        """Whether `made` stays on the CPU wherever the model is: made with no device named from
        nothing (a factory) or only from such tensors (`torch.arange(n) + 0.5`). Remembered, so
        what is computed from them is too; tensors made before the guard count as the model's."""
        host = not _names_device(args, kwargs) and all(self._is_host(t) for t in given)
        if host:
            for t in made:
                if t.device.type == "cpu":
                    self.host[id(t)] = weakref.ref(t, self._forget(id(t)))
        return host

    def _forget(self, key: int) -> Callable[[weakref.ref], object]:
        return lambda _: self.host.pop(key, None)  # the tensor is gone; its id may come again

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t


def _names_device(args, kwargs) -> bool:
    """Whether a call says where its result goes (`device=`, or `.to(device)`)."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, torch.device | str) for a in args[1:])


def _tensors(x) -> Iterator[object]:
    if isinstance(x, tuple | list):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    else:
        yield x


# frames passed over to find who made a call: this module, torch's wrappers, the type checkers'
_WRAPPERS = frozenset({"torch", "jaxtyping", "typeguard", "contextlib"})
# the model's own libraries: their modules keep their own precision (norms in float32)
LIBRARIES = frozenset(
    {"transformer_lens", "transformers", "nnsight", "einops", "fancy_einsum", "accelerate", "sae_lens"}
)


def _package(frame) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def _passed_over(frame) -> bool:
    """This module's frames, torch's and the type checkers' (and any module marked a wrapper)."""
    return frame.f_globals.get("__name__") == __name__ or _package(frame) in _WRAPPERS or wraps_calls(frame)


def _caller() -> str:
    """The top-level package of the Python code that made the call (this module, torch's and the
    type checkers' wrappers passed over)."""
    frame: FrameType | None = sys._getframe(3)
    while frame is not None and _passed_over(frame):
        frame = frame.f_back
    return _package(frame) if frame is not None else ""


def _where() -> str:
    """The innermost kvnotes/probes/circuits line on the stack (this module left out), and the
    line that made the call where it is elsewhere (TransformerLens, torch)."""
    frame: FrameType | None = sys._getframe(2)
    outer = None
    inner = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not _passed_over(frame):
            inner = inner or f"{Path(path).name}:{frame.f_lineno} in {frame.f_code.co_name}"
            if path.startswith(PROJECT):
                outer = f"{_short(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
                break
        frame = frame.f_back
    if outer is None:
        return inner or "unknown"
    return outer if inner is None or inner.split(" in ")[0] in outer else f"{outer}, via {inner}"


def _short(path: str) -> str:
    for root in PROJECT:
        if path.startswith(root):
            return str(Path(root).name / Path(path).relative_to(root))
    return path


@contextmanager
def guard(
    model=None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    factories: bool = True,
    collect: bool = False,
) -> Iterator[list[str]]:
    """Raise `PlacementError` when a torch call inside the block makes a tensor off `model`'s
    device or dtype (module docstring for the rule); `device`/`dtype` override the model's. Yields
    the list of violations (empty when the block passes); `collect=True` lets the block run on and
    raises at its end, listing every violation (each once). The message names the call and the
    kvnotes line that made it:

    >>> from kvnotes import load_model, prefill
    >>> model = load_model("tiny-llama", dtype="bfloat16")
    >>> with guard(model):
    ...     _ = prefill(model, "The order has shipped.")
    >>> with guard(model):
    ...     torch.zeros(2, device=model.device)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    kvnotes.engine.guard.PlacementError: torch zeros made a torch.float32 tensor; the model ...
    """
    want_device = torch.device(device) if device is not None else model.device
    want_dtype = dtype if dtype is not None else model.dtype
    mode = _Guard(want_device, want_dtype, factories, collect)
    with mode:
        yield mode.violations
    if mode.violations:
        seen = list(dict.fromkeys(mode.violations))
        raise PlacementError(f"{len(seen)} placement violation(s):\n" + "\n".join(seen))


__all__ = ["EXITS", "PlacementError", "allow", "guard"]
