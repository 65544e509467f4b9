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


def logit_errors(errors: dict) -> Figure:
    """Largest |ours - reference| logit error at every position, one line per prompt (log scale)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, row_abs in errors.items():
        ax.plot(range(len(row_abs)), [max(float(e), 1e-12) for e in row_abs], lw=0.8, label=str(label))
    ax.set_yscale("log")
    ax.set_xlabel("position (prompt + output)")
    ax.set_ylabel("max |logit error|")
    ax.set_title("target logits: ours against the reference")
    if len(errors) <= 8:
        ax.legend(fontsize=7)
    plt.close(fig)
    return fig
