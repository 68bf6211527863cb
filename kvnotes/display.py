"""Rich display for result objects: `.figure()` and a notebook HTML repr, rendered elsewhere.

The engine and the analyses never import plotly (imports point down only). A result class that
inherits `Displayable` finds its renderer through the `kvnotes.renderers` entry point, which
the `dashboards` package registers; a different renderer can be installed the same way.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

from kvnotes.errors import NoRendererError


@cache
def renderer():
    """The installed renderer module (`dashboards.render` unless another is registered)."""
    eps = sorted(entry_points(group="kvnotes.renderers"), key=lambda e: e.name != "dashboards")
    if not eps:
        raise NoRendererError(
            "no kvnotes renderer is installed (entry point group 'kvnotes.renderers'); "
            "reinstall kvnotes (`pip install -e .`) so that `dashboards` registers itself"
        )
    return eps[0].load()


class Displayable:
    """Mixin: `figure()` returns the plotly figure of a result; notebooks show its HTML view."""

    def figure(self):
        """The plotly figure of this result (a `plotly.graph_objects.Figure`)."""
        return renderer().figure(self)

    def _repr_html_(self) -> str:
        return renderer().html(self)
