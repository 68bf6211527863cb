"""Hook point names, spelled once, in TransformerLens's naming (`blocks.{layer}.{site}`).

The engine fires TransformerLens's own hook points, so these names mean what they mean in a
`model.tl` forward and in sae-lens.
"""

from __future__ import annotations

import operator

from kvnotes.errors import BadArgument

SITES = (
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_z",
    "attn.hook_pattern",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_pre",
    "hook_resid_post",
)


def hook_name(layer: int, site: str) -> str:
    """The hook point of `site` at block `layer`, e.g. `hook_name(3, "attn.hook_z")` is
    `"blocks.3.attn.hook_z"`. `site` is one of `SITES`; anything else raises `BadArgument`.

    >>> hook_name(1, "hook_resid_post")
    'blocks.1.hook_resid_post'
    """
    if site not in SITES:
        raise BadArgument(f"unknown hook site {site!r}; the sites are {', '.join(SITES)}")
    try:
        index = operator.index(layer)
    except TypeError:
        index = -1
    if isinstance(layer, bool) or index < 0:
        raise BadArgument(f"layer must be a block index (an integer of at least 0), got {layer!r}")
    return f"blocks.{index}.{site}"
