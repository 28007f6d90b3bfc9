"""A run's `loss.png`: its loss against the iteration beside fault-free training's (the
reference the run was checked against), failures and recoveries marked. Drawn after the run
whenever the reference ran (local and dist with report.check_fault_free)."""
from __future__ import annotations

import warnings
from pathlib import Path


def plot_loss(summary: dict, path: Path) -> Path | None:
    """loss.png from the summary's `losses` and `fault_free_losses`; None when either is missing."""
    losses, reference = summary.get("losses"), summary.get("fault_free_losses")
    if not losses or not reference:
        return None
    import matplotlib
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(range(len(reference)), reference, color="#555555", linewidth=2.4, alpha=0.5,
            label="fault-free training (the reference)")
    shown = [(i, v) for i, v in enumerate(losses) if isinstance(v, (int, float))]
    ax.plot([i for i, _ in shown], [v for _, v in shown], color="#4C72B0", linewidth=1.2, marker=".",
            label=f"this run ({summary.get('strategy')}, {summary.get('backend')})")
    marked = set()
    for r in summary.get("recoveries") or []:
        if not isinstance(r, dict) or r.get("iteration") is None:
            continue
        cause = r.get("cause", "fail")
        colour = "#C44E52" if cause == "fail" else "#55A868"
        ax.axvline(r["iteration"], color=colour, linestyle=":", linewidth=1.0,
                   label=("failure" if cause == "fail" else "join") if cause not in marked else None)
        marked.add(cause)
        restored = r.get("restored_iteration")
        if restored is not None and restored < r["iteration"]:  # the iterations it redid
            ax.axvspan(restored, r["iteration"], color=colour, alpha=0.08,
                       label="redone after a restore" if "redone" not in marked else None)
            marked.add("redone")
    verdict = summary.get("matches_fault_free")
    said = {True: "matches fault-free training", False: "differs from fault-free training"}.get(verdict, "")
    ax.set_title(f"loss per iteration{': ' + said if said else ''}", fontsize=10)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, facecolor="white")
    plt.close(fig)
    return path


def plot_loss_quietly(summary: dict, run_dir: Path) -> Path | None:
    """plot_loss into the run folder: a plot must never cost the run its results."""
    try:
        return plot_loss(summary, Path(run_dir) / "loss.png")
    except Exception as err:
        warnings.warn(f"could not draw loss.png: {type(err).__name__}: {err}")
        return None
