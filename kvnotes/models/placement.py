"""Where a model runs and in what precision: the devices and dtypes `load_model` and `--device` /
`--dtype` accept, checked before any load.

A device is "cpu", "cuda", "cuda:N" or "mps" (or a `torch.device`); it must be available here:
CUDA present with more than N devices, MPS built and available. A dtype is float32 (the default),
bfloat16 or float16 (a name, with or without "torch.", or a `torch.dtype`). float64 is not a load
dtype: it is verify's truth, which kvnotes computes itself from a float32 (or lower) model
(`kvnotes.engine.in_float64`); a float64 model would leave verify nothing above it to measure by.
Anything else is refused in one line naming the way out (`BadArgument`).

    >>> placement("cpu", "bfloat16")
    (device(type='cpu'), torch.bfloat16)
    >>> placement(None, None)
    (device(type='cpu'), torch.float32)
    >>> placement("cpu", "int8")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    kvnotes.errors.BadArgument: dtype 'int8' is not a dtype kvnotes loads models in; give float32 ...
"""

from __future__ import annotations

import torch

from kvnotes.errors import BadArgument

DEFAULT_DEVICE = "cpu"
DEFAULT_DTYPE = "float32"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICE_KINDS = ("cpu", "cuda", "mps")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """`dtype` as a `torch.dtype` kvnotes loads models in (None: float32), else `BadArgument`."""
    if dtype is None:
        return DTYPES[DEFAULT_DTYPE]
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        shown = str(dtype)
    else:
        shown = str(dtype)
        name = shown.strip().lower().removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    why = (
        " (verify's float64 truth is computed, not loaded)" if "float64" in shown or "double" in shown else ""
    )
    raise BadArgument(
        f"dtype {shown!r} is not a dtype kvnotes loads models in{why}; give float32 (the default), "
        "bfloat16 or float16"
    )


def parse_device(device: str | torch.device | None) -> torch.device:
    """`device` as a `torch.device` of a kind kvnotes runs on (None: cpu); not checked for being
    present here (`check_device` does that)."""
    if device is None:
        return torch.device(DEFAULT_DEVICE)
    if isinstance(device, torch.device):
        parsed = device
    else:
        try:
            parsed = torch.device(str(device).strip().lower())
        except RuntimeError:
            parsed = None
    if parsed is None or parsed.type not in DEVICE_KINDS:
        raise BadArgument(
            f"device {str(device)!r} is not one kvnotes runs on; give cpu (the default), cuda, cuda:N or mps"
        )
    return parsed


def check_device(device: torch.device) -> torch.device:
    """`device` when it is present on this machine, else `BadArgument` naming what is."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BadArgument(
                f"device {str(device)!r} is not available: this machine has no CUDA device (or this "
                "torch was built without CUDA); give --device cpu, or install a CUDA build of torch "
                "on a machine with a GPU"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise BadArgument(
                f"device {str(device)!r} is not available: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}; give one of them"
            )
    if device.type == "mps" and not (torch.backends.mps.is_built() and torch.backends.mps.is_available()):
        raise BadArgument(
            f"device {str(device)!r} is not available: MPS needs Apple silicon and a torch built with "
            "it; give --device cpu"
        )
    return device


def same_device(have: torch.device, want: torch.device | str) -> bool:
    """Whether a tensor on `have` is on `want` ("cuda" means any CUDA device, "cuda:1" that one).

    >>> same_device(torch.device("cpu"), "cpu"), same_device(torch.device("cpu"), "meta")
    (True, False)
    """
    want = torch.device(want)
    return have.type == want.type and (want.index is None or have.index == want.index)


def placement(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) checked: both of a kind kvnotes runs, the device present here. Loaders call
    this before they load anything, so a bad pair is refused at once."""
    return check_device(parse_device(device)), resolve_dtype(dtype)


__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_DTYPE",
    "DTYPES",
    "check_device",
    "parse_device",
    "placement",
    "resolve_dtype",
    "same_device",
]
