"""Rendering only: plotly figures of kvnotes results, the self-contained report page, the local
dashboard server and the notebook patching widget. Nothing here computes an analysis.

    from dashboards.render import write_report, write_page, compare_html, figure
    from dashboards.server import serve          # or: kvnotes dashboard DIR
    from dashboards.widget import PatchingView   # pip install 'kvnotes[notebook]'

Result objects find `dashboards.render` through the `kvnotes.renderers` entry point, so
`result.figure()` and a notebook's rich display work without importing this package.
"""
