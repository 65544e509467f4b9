"""The report's plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import collections

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def histogram_bars(histograms: dict[str, dict[int, int]], title: str) -> Figure:
    """Side-by-side bars of the share of rounds per acceptance length, one colour per series."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    lengths = sorted({n for h in histograms.values() for n in h})
    width = 0.8 / max(len(histograms), 1)
    for i, (label, hist) in enumerate(histograms.items()):
        total = sum(hist.values()) or 1
        xs = [n + (i - (len(histograms) - 1) / 2) * width for n in lengths]
        ax.bar(xs, [hist.get(n, 0) / total for n in lengths], width, label=label)
    ax.set_xlabel("acceptance length (tokens per round)")
    ax.set_ylabel("share of rounds")
    ax.set_xticks(lengths)
    ax.set_title(title)
    ax.legend()
    plt.close(fig)
    return fig


def acceptance_histograms(outputs: dict) -> Figure:
    """Acceptance-length histograms of each method's results (`outputs`: label -> Result list)."""
    hists = {
        label: dict(collections.Counter(a for r in results for a in r.acceptance_lengths))
        for label, results in outputs.items()
    }
    return histogram_bars(hists, "acceptance lengths")
