"""Bar charts of bench results as small PNGs (matplotlib, Agg: no display needed).

matplotlib is in the `bench` extra; without it a bench still prints and writes JSON and
says that it drew no plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def bar_chart(
    path: str,
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    note: str = "",
) -> str | None:
    """Grouped bars: one group per x label, one bar per series. Returns None when drawn,
    else why not (matplotlib missing)."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'polarkv[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, list(values), width, label=name)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(
        fontsize=8,
        ncols=min(6, len(series)),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        frameon=False,
    )
    ax.grid(axis="y", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    fig.tight_layout()
    # A small palette-free PNG: these are committed under docs/.
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return None
