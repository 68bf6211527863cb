"""The order-status prompt that `kvnotes verify` and the benches measure on, and its aligned pairs.

Top level because both the conformance checks and the benches build on it; the engine never
imports a bench.
"""

from __future__ import annotations

from kvnotes.errors import TokenCountChanged
from kvnotes.models.model import KVModel
from kvnotes.prompt import Prompt, Template

POLICY = (
    "[[policy:Policy: an order may be cancelled while its status is pending. Once an order "
    "has shipped, deny the cancellation and offer a return instead.]]\n"
)
FILLER = "Note {i}: refunds are allowed within 30 days; keep the customer informed.\n"
STATE = "Customer: Alice. Order id: 1234.\norder_status: {order_status}.\n"
QUERY = "[[query:Q: Can the order be cancelled?]]\n[[decision:A:]]"
VALUES = ("pending", "shipped", "delivered", "processing", "returned", "cancelled", "open", "closed")


def filled_pair(model: KVModel, before: str, after: str, min_tokens: int) -> tuple[Prompt, Prompt]:
    """An aligned (old, new) `order_status` pair of template `before + filler lines + after`,
    with just enough filler lines for at least `min_tokens` tokens."""
    n_filler = 0
    while True:
        filler = "".join(FILLER.format(i=i) for i in range(n_filler))
        old, new = _aligned_pair(model, Template(before + filler + after))
        if len(old) >= min_tokens:
            return old, new
        n_filler += max(1, (min_tokens - len(old)) // 40)  # creep up: lines are 14-40 tokens


def _aligned_pair(model: KVModel, tpl: Template) -> tuple[Prompt, Prompt]:
    for a in VALUES:
        old = tpl.render(model, order_status=a)
        for b in VALUES:
            if b == a:
                continue
            try:
                return old, old.with_values(model, order_status=b)
            except TokenCountChanged:
                continue
    raise TokenCountChanged(f"no two order_status values tokenize to the same length under {model.name}")
