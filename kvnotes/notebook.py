"""The Notebook: a model's KV cache as an immutable, position-addressed object.

Per layer, `keys` and `values` are `[batch, n_kv_heads, slot, d_head]`; keys are post-RoPE, as
Hugging Face and vLLM store them. `positions[s]` is slot s's RoPE position; attention is causal
*by position*, so slot order carries no meaning. Every operation returns a new Notebook;
unchanged tensors are shared, never mutated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvnotes.errors import (
    CorruptNotebook,
    FingerprintMismatch,
    NotebookNotFound,
    OutOfRange,
    ShapeMismatch,
    UnknownField,
)
from kvnotes.types import Int, Tensor

FORMAT = "kvnotes.notebook"
FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)
class Notebook:
    """A hooked KV cache: per-layer post-RoPE keys and values plus what each slot is."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    positions: Int[Tensor, " slot"]
    tokens: Int[Tensor, "batch slot"]
    fingerprint: str
    model_name: str
    spans: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.keys) != len(self.values):
            raise CorruptNotebook(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        n = self.positions.shape[0]
        for l, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.ndim != 4 or k.shape != v.shape or k.shape[2] != n or k.shape[0] != self.tokens.shape[0]:
                raise CorruptNotebook(
                    f"layer {l}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not match "
                    f"{n} positions and tokens {tuple(self.tokens.shape)}"
                )
        if self.tokens.shape[1] != n:
            raise CorruptNotebook(f"{self.tokens.shape[1]} tokens for {n} positions")

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def empty(cls, model, batch: int = 1) -> Notebook:
        """A notebook with no slots for `model` (what `prefill` starts from)."""
        shape = (batch, model.n_kv_heads, 0, model.d_head)
        kv = tuple(torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(model.n_layers))
        return cls(
            keys=kv,
            values=kv,
            positions=torch.zeros(0, dtype=torch.long),
            tokens=torch.zeros(batch, 0, dtype=torch.long),
            fingerprint=model.fingerprint,
            model_name=model.name,
        )

    # --- facts -------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_slots(self) -> int:
        return self.positions.shape[0]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def next_position(self) -> int:
        """The position right after the last slot (where an appended token goes)."""
        return int(self.positions.max()) + 1 if self.n_slots else 0

    def span(self, name: str) -> range:
        """The positions of named span `name` as a range."""
        if name not in self.spans:
            raise UnknownField(f"no span {name!r} in this notebook; it has {sorted(self.spans)}")
        start, end = self.spans[name]
        return range(start, end)

    def slot_index(self, positions: Sequence[int] | Tensor) -> Int[Tensor, " n"]:
        """Slot indices holding `positions`; errors on a position the notebook does not hold."""
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if pos.numel() == 0:
            return pos
        match = self.positions[None, :] == pos[:, None]
        missing = ~match.any(1)
        if missing.any():
            bad = pos[missing].tolist()
            raise OutOfRange(
                f"position(s) {bad[:8]} not in this notebook (it holds "
                f"{self.n_slots} slots, positions {self._pos_summary()})"
            )
        return match.to(torch.uint8).argmax(1)  # each row has one match; no float made

    def _pos_summary(self) -> str:
        if self.n_slots == 0:
            return "none"
        return f"{int(self.positions.min())}..{int(self.positions.max())}"

    def check_model(self, model) -> None:
        if self.fingerprint != model.fingerprint:
            raise FingerprintMismatch(
                f"this notebook was written by {self.model_name!r} (fingerprint "
                f"{self.fingerprint[:12]}) but the model is {model.name!r} ({model.fingerprint[:12]}); "
                "prefill the prompt again with this model"
            )

    def check_compatible(self, other: Notebook) -> None:
        if self.fingerprint != other.fingerprint:
            raise FingerprintMismatch(
                f"notebooks from different models cannot be mixed: {self.model_name!r} "
                f"({self.fingerprint[:12]}) vs {other.model_name!r} ({other.fingerprint[:12]})"
            )

    # --- tensor surgery (no compute) ---------------------------------------------------------
    def select(self, positions: Sequence[int] | Tensor) -> Notebook:
        """Keep only the slots at `positions` (in that order)."""
        idx = self.slot_index(positions)
        kept = set(self.positions[idx].tolist())
        spans = {n: s for n, s in self.spans.items() if all(p in kept for p in range(*s))}
        return replace(
            self,
            keys=tuple(k[:, :, idx] for k in self.keys),
            values=tuple(v[:, :, idx] for v in self.values),
            positions=self.positions[idx],
            tokens=self.tokens[:, idx],
            spans=spans,
        )

    def truncate(self, before: int) -> Notebook:
        """Drop every slot at position >= `before`."""
        keep = (self.positions < before).nonzero().flatten()
        return self.select(self.positions[keep])

    def concat(self, other: Notebook) -> Notebook:
        """Slots of `self` then `other`; positions must not collide."""
        self.check_compatible(other)
        clash = set(self.positions.tolist()) & set(other.positions.tolist())
        if clash:
            raise OutOfRange(f"cannot concatenate: both notebooks hold position(s) {sorted(clash)[:8]}")
        a, b = _broadcast(self, other)
        return replace(
            a,
            keys=tuple(torch.cat([x, y], 2) for x, y in zip(a.keys, b.keys)),
            values=tuple(torch.cat([x, y], 2) for x, y in zip(a.values, b.values)),
            positions=torch.cat([a.positions, b.positions]),
            tokens=torch.cat([a.tokens, b.tokens], 1),
            spans={**a.spans, **b.spans},
        )

    def expand(self, batch: int) -> Notebook:
        """Broadcast a batch-1 notebook to `batch` copies (views, no memory)."""
        if self.batch == batch:
            return self
        if self.batch != 1:
            raise ShapeMismatch(
                f"cannot expand a batch of {self.batch} to {batch}; only a batch-1 notebook "
                "expands (index one with nb[i])"
            )
        return replace(
            self,
            keys=tuple(k.expand(batch, -1, -1, -1) for k in self.keys),
            values=tuple(v.expand(batch, -1, -1, -1) for v in self.values),
            tokens=self.tokens.expand(batch, -1),
        )

    def to(self, device: str | torch.device) -> Notebook:
        """The same notebook with its keys and values on `device` (positions and tokens stay on CPU)."""
        return replace(
            self, keys=tuple(k.to(device) for k in self.keys), values=tuple(v.to(device) for v in self.values)
        )

    def __getitem__(self, i: int | slice) -> Notebook:
        """One batch element (or a slice of them) as a notebook."""
        sl = slice(i, i + 1) if isinstance(i, int) else i
        return replace(
            self,
            keys=tuple(k[sl] for k in self.keys),
            values=tuple(v[sl] for v in self.values),
            tokens=self.tokens[sl],
        )

    @classmethod
    def stack(cls, notebooks: Sequence[Notebook]) -> Notebook:
        """Concatenate notebooks with identical slot layouts along the batch axis."""
        first = notebooks[0]
        for nb in notebooks[1:]:
            first.check_compatible(nb)
            if not torch.equal(nb.positions, first.positions):
                raise ShapeMismatch(
                    "can only stack notebooks whose slots hold the same positions; "
                    "select the same positions in each first (nb.select(...))"
                )
        return replace(
            first,
            keys=tuple(torch.cat(ks, 0) for ks in zip(*(nb.keys for nb in notebooks))),
            values=tuple(torch.cat(vs, 0) for vs in zip(*(nb.values for nb in notebooks))),
            tokens=torch.cat([nb.tokens for nb in notebooks], 0),
        )

    # --- persistence: safetensors + a JSON header, never pickle ------------------------------
    def save(self, path: str | Path) -> Path:
        """Write to `path` (safetensors). Tensors only; metadata is a JSON string."""
        from safetensors.torch import save_file

        tensors = {"positions": self.positions, "tokens": self.tokens.contiguous()}
        for l, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"keys.{l}"] = k.contiguous()
            tensors[f"values.{l}"] = v.contiguous()
        header = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "model_name": self.model_name,
            "n_layers": self.n_layers,
            "spans": {k: list(v) for k, v in self.spans.items()},
        }
        path = Path(path)
        save_file(
            {k: t.detach().cpu() for k, t in tensors.items()},
            str(path),
            metadata={"kvnotes": json.dumps(header)},
        )
        return path

    @classmethod
    def load(cls, path: str | Path, model=None) -> Notebook:
        """Read a notebook written by `save`; with `model`, also check it belongs to that model."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise NotebookNotFound(f"no notebook at {path}; check the path, or write one with Notebook.save")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                header = json.loads(meta["kvnotes"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - any read failure means the file is unusable
            raise CorruptNotebook(
                f"{path} is not a readable kvnotes notebook ({type(e).__name__}: {e}); "
                "re-create it with Notebook.save"
            ) from e
        if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
            raise CorruptNotebook(f"{path}: unknown format {header.get('format')!r} v{header.get('version')}")
        try:
            n = int(header["n_layers"])
            nb = cls(
                keys=tuple(tensors[f"keys.{l}"] for l in range(n)),
                values=tuple(tensors[f"values.{l}"] for l in range(n)),
                positions=tensors["positions"],
                tokens=tensors["tokens"],
                fingerprint=header["fingerprint"],
                model_name=header["model_name"],
                spans={k: (int(a), int(b)) for k, (a, b) in header["spans"].items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptNotebook(f"{path}: missing or inconsistent field ({e}); re-create it") from e
        if model is not None:
            nb.check_model(model)
        return nb

    def __repr__(self) -> str:
        return (
            f"Notebook({self.model_name!r}, batch={self.batch}, slots={self.n_slots}, "
            f"positions={self._pos_summary()}, layers={self.n_layers}, spans={sorted(self.spans)})"
        )


def _broadcast(a: Notebook, b: Notebook) -> tuple[Notebook, Notebook]:
    if a.batch == b.batch:
        return a, b
    n = max(a.batch, b.batch)
    return a.expand(n), b.expand(n)
