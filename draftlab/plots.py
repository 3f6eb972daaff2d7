"""Training-run plots (PNG, matplotlib's Agg backend so they work on headless machines)."""
from __future__ import annotations

from pathlib import Path


def plot_tau_curve(history: list[dict], path: str | Path, draft_length: int | None = None) -> Path:
    """Acceptance length tau against training step; `history` rows have `step` and `tau`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    taus = [h["tau"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, taus, marker="o", label="acceptance length tau")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="no speculation (tau = 1)")
    if draft_length:
        ax.axhline(draft_length + 1, color="grey", lw=0.8, ls="--", label=f"upper bound k+1 = {draft_length + 1}")
    ax.set_xlabel("training step")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("In-loop acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
