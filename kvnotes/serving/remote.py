"""Experiments on NDIF through nnsight: the caches stay on the server, only the numbers come back.

`slot_sweep(model, pair, remote=...)` is the per-slot transplant sweep (every layer's K/V of one
slot copied from the `new` prompt's cache into the `old` prompt's, the decision read each time)
written as one nnsight *session*: the two prefills run as traces inside it, their caches stay as
server-side values, each batch of patches copies the old cache on the server and runs only the
decision tokens against it, and the only thing saved is one logit difference per slot. So the
request carries token ids, slot indices and two answer ids; a notebook never crosses the network.

remote:
- False: the session runs here, on a model loaded with weights (`load_model(name, backend="nnsight")`).
- "local": nnsight's dry run of the remote path: the request is built and serialized exactly as for
  NDIF, deserialized with this machine's own modules hidden (as the server has none of them), and
  run here. `SlotSweep.request` records what it carried (bytes, and every tensor in it).
- True, or a host URL: the request goes to NDIF (or that host). The model is the hub name NDIF
  serves, loaded without weights (`load_model(name, backend="nnsight", remote=True)`). The API key
  is nnsight's own (`NDIF_API_KEY`, or `nnsight.CONFIG.set_default_api_key`); kvnotes never reads,
  stores or prints it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvnotes.display import Displayable
from kvnotes.engine import Capability, require
from kvnotes.errors import BadArgument, KVNotesError

KEY_HELP = (
    "NDIF needs an API key: set NDIF_API_KEY in the environment, or once: python -c "
    "\"import nnsight; nnsight.CONFIG.set_default_api_key('YOUR_KEY')\" (a key comes from https://login.ndif.us)"
)


class RemoteUnavailable(KVNotesError):
    """NDIF (or the host given) could not run the request: no key, no connection, or a refusal."""


@dataclass(frozen=True)
class Request:
    """What a dry run's request carried: its size, and every tensor in its shipped variables."""

    payload_bytes: int
    tensors: dict[str, tuple[int, ...]]  # variable name -> shape

    @property
    def largest_tensor(self) -> int:
        return max((int(torch.Size(s).numel()) for s in self.tensors.values()), default=0)


@dataclass(frozen=True)
class SlotSweep(Displayable):
    """Per slot, the decision's logit difference (answers[0] - answers[1]) with that slot's K/V (all
    layers) moved from `new` into `old`; `recovery` against the unpatched ends."""

    model: str
    where: str  # "here", "dry run of the remote path", or the host
    slots: list[int]
    ld: list[float]
    ld_old: float
    ld_new: float
    request: Request | None = None
    recovery: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.recovery:
            span = self.ld_new - self.ld_old
            rec = [(x - self.ld_old) / span if span else float("nan") for x in self.ld]
            object.__setattr__(self, "recovery", rec)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SlotSweep:
        request = (
            Request(**{**d["request"], "tensors": {k: tuple(v) for k, v in d["request"]["tensors"].items()}})
            if d.get("request")
            else None
        )
        return cls(**{**d, "request": request})

    def table(self) -> str:
        lines = [
            f"slot sweep — {self.model} — run {self.where}",
            f"ld old {self.ld_old:+.3f}, new {self.ld_new:+.3f}",
            f"{'slot':>6}{'ld':>10}{'recovery':>10}",
        ]
        lines += [f"{s:>6}{x:>+10.3f}{r:>10.3f}" for s, x, r in zip(self.slots, self.ld, self.recovery)]
        if self.request is not None:
            lines.append(
                f"request: {self.request.payload_bytes:,} bytes; largest tensor in it "
                f"{self.request.largest_tensor} elements"
            )
        return "\n".join(lines)


def slot_sweep(
    model,
    pair,
    slots: Sequence[int] | None = None,
    *,
    batch_size: int = 8,
    remote: bool | str = False,
) -> SlotSweep:
    """Move each slot of `slots` (default: every slot after the changed field, before the
    decision) from `pair.new`'s cache into `pair.old`'s, all layers, and read the decision.

    pair: a `kvnotes.tasks.sampler.Pair` (or anything with aligned `old`/`new` prompts, a
    "decision" span and two `answers`). remote: False, "local" (nnsight's dry run of the request)
    or True / a host URL (NDIF); see the module docstring.
    """
    where = " on NDIF (load with remote=True)" if remote is True else ""
    require(model, Capability.REMOTE, f"remote experiments{where}")
    stop = pair.old.span("decision").start
    slots = list(pair.downstream() if slots is None else slots)
    bad = [s for s in slots if not 0 <= s < stop]
    if bad:
        raise BadArgument(f"slots {bad} are not prefix slots; give positions in 0..{stop - 1}")
    if batch_size < 1:
        raise BadArgument("batch_size must be at least 1")
    backend = _backend(model, remote)
    old = torch.tensor([list(pair.old.ids)])
    new = torch.tensor([list(pair.new.ids)])
    lds, ends = _session(model.lm, old, new, stop, slots, tuple(pair.answers), batch_size, backend)
    where = {False: "here", "local": "dry run of the remote path"}.get(
        remote, str(getattr(backend, "host", remote))
    )
    request = getattr(backend, "request", None)
    return SlotSweep(
        model=model.name,
        where=where,
        slots=slots,
        ld=[float(x) for x in lds],
        ld_old=float(ends[0]),
        ld_new=float(ends[1]),
        request=request,
    )


def _session(lm, old, new, stop, slots, answers, batch_size, backend):
    """The sweep as one nnsight session. Everything inside the `with` block is what the server
    runs: plain torch and the model, no kvnotes code (the server has no kvnotes)."""
    a, b = answers
    batches = [slots[i : i + batch_size] for i in range(0, len(slots), batch_size)]
    decision = old[:, stop:]
    with lm.session(backend=backend):
        with lm.trace(old[:, :stop]):
            out = lm.output
            dst = getattr(out, "cache", None) or out.past_key_values
        with lm.trace(new[:, :stop]):
            out = lm.output
            src = getattr(out, "cache", None) or out.past_key_values
        ends = [].save()
        for prompt in (old, new):
            with lm.trace(prompt, logits_to_keep=1):
                logits = lm.output.logits[0, -1]
                ends.append((logits[a] - logits[b]).item())
        lds = [].save()
        for batch in batches:
            cache = copy.deepcopy(dst)
            cache.batch_repeat_interleave(len(batch))
            for layer, source in zip(cache.layers, src.layers):
                first = layer.get_seq_length() - layer.keys.shape[-2]  # a sliding layer's oldest slot
                for row, slot in enumerate(batch):
                    if slot >= first:
                        layer.keys[row, :, slot - first] = source.keys[0, :, slot - first]
                        layer.values[row, :, slot - first] = source.values[0, :, slot - first]
            tokens = decision.expand(len(batch), -1)
            mask = torch.ones(len(batch), stop + tokens.shape[1], dtype=torch.long)
            with lm.trace(tokens, attention_mask=mask, cache=cache, logits_to_keep=1):
                logits = lm.output.logits[:, -1]
                lds.extend((logits[:, a] - logits[:, b]).tolist())
    return lds, ends


# --- backends --------------------------------------------------------------------------------------
def _backend(model, remote):
    if remote is False or remote is None:
        return None
    if remote == "local":
        return _dry_run(model.lm)
    return _ndif(model, remote)


def _dry_run(lm):
    """nnsight's local simulation of a remote request, recording what the request carried."""
    from nnsight.intervention.backends.local import LocalSimulationBackend
    from nnsight.schema.request import RequestModel

    class DryRun(LocalSimulationBackend):
        request: Request | None = None

        def __call__(self, tracer):
            blob = RequestModel.serialize(tracer, compress=False)
            variables = dict(tracer.info.frame.f_locals)
            tensors = {name: tuple(v.shape) for name, v in _walk(variables) if isinstance(v, torch.Tensor)}
            self.request = Request(payload_bytes=len(blob), tensors=tensors)
            return super().__call__(tracer)

    return DryRun(lm)


def _walk(obj, name: str = "", depth: int = 0):
    """(name, value) of `obj` and what it holds (dicts, lists, tuples), a few levels deep."""
    yield name, obj
    if depth > 4:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{name}.{k}" if name else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{name}[{i}]", depth + 1)
    elif not isinstance(obj, torch.nn.Module) and type(obj).__module__.split(".")[0] in (
        "transformers",
        "kvnotes",
    ):
        for k, v in vars(obj).items():  # a cache or a notebook shipped whole
            yield from _walk(v, f"{name}.{k}", depth + 1)


def _ndif(model, remote):
    """The NDIF backend, after the checks that need no network: a key, a model key."""
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import RemoteBackend

    if not (os.environ.get("NDIF_API_KEY") or CONFIG.API.APIKEY):
        raise RemoteUnavailable(KEY_HELP)
    host = remote if isinstance(remote, str) else CONFIG.API.HOST
    try:
        key = model.lm.to_model_key()
    except Exception as e:  # nnsight raises several kinds here
        raise RemoteUnavailable(
            f"{model.name} has no NDIF model key ({type(e).__name__}); remote runs take a hub name "
            "NDIF serves, loaded with load_model(name, backend='nnsight', remote=True)"
        ) from None

    class Guarded(RemoteBackend):
        """nnsight's RemoteBackend, its failures turned into a RemoteUnavailable that names the
        host and the way out (never the key)."""

        def __call__(self, tracer=None):
            try:
                return super().__call__(tracer)
            except Exception as e:
                raise RemoteUnavailable(
                    f"NDIF at {self.host} did not run the request: {type(e).__name__}: {_scrub(str(e))}. "
                    "Check the network and the service (python -c 'import nnsight; "
                    "nnsight.ndif.status()'), the model name (NDIF serves a fixed list) and the key; "
                    "or run the same sweep here with remote=False on a model loaded with its weights"
                ) from None

    return Guarded(key, host=host)


def _scrub(text: str) -> str:
    """`text` with any API key nnsight knows of blanked out."""
    from nnsight import CONFIG

    for secret in {os.environ.get("NDIF_API_KEY"), CONFIG.API.APIKEY} - {None, ""}:
        text = text.replace(secret, "***")
    return text[:400]
