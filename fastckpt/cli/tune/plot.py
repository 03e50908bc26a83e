"""``fastckpt tune --plot``: GB/s against each swept parameter, one line per engine.

matplotlib is optional (``pip install matplotlib``, or ``pip install '.[plot]'`` in a clone); :func:`require_matplotlib` says
so before the sweep starts rather than after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fastckpt.cli._common import USAGE, CliError
from fastckpt.cli.tune.sweep import PARAMETERS, Result, show

__all__ = ["plot_results", "require_matplotlib"]


def require_matplotlib() -> None:
    """Fails with status 2, saying what to install, where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or, in a clone of fastckpt, pip install '.[plot]')",
            USAGE,
        ) from None


def plot_results(
    results: Iterable[Result],
    sweep: dict[str, list[Any]],
    path: str,
    *,
    read: bool = True,
    write: bool = True,
) -> None:
    """Draws GB/s against each swept parameter, one line per engine and direction.

    Each point is the best median over the other parameters at that value: how far the
    device can go with the parameter set so. Parameters with a single value are left out
    (with none left, GB/s is drawn per engine).

    Example:
        >>> import tempfile, os
        >>> rs = [Result({"block_size": b, "queue_depth": 8, "single_submit": False,
        ...               "overlap_events": True, "intra_op_parallelism": 1, "engine": "threads"},
        ...              read=[b / 1e6], write=[b / 2e6]) for b in (1 << 18, 1 << 20)]
        >>> sweep = {"block_size": [1 << 18, 1 << 20], "queue_depth": [8], "engine": ["threads"],
        ...          "single_submit": [False], "overlap_events": [True], "intra_op_parallelism": [1]}
        >>> out = os.path.join(tempfile.mkdtemp(), "sweep.png")
        >>> plot_results(rs, sweep, out)  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if not r.error]
    panels = [p for p in PARAMETERS if len(sweep.get(p, [])) > 1] or ["engine"]
    directions = [d for d, on in (("read", read), ("write", write)) if on]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, param in zip(axes[0], panels):
        values = sweep[param]
        positions = list(range(len(values)))
        lines = (
            [(engine, d) for engine in sweep["engine"] for d in directions]
            if param != "engine"
            else [(None, d) for d in directions]
        )
        colors = {engine: f"C{i}" for i, engine in enumerate(sweep["engine"])}
        for engine, direction in lines:
            ys = []
            for value in values:
                rates = [
                    getattr(r, f"{direction}_gbps")
                    for r in good
                    if r.config[param] == value and (engine is None or r.config["engine"] == engine)
                ]
                ys.append(max(rates) if rates else math.nan)
            label = f"{engine} {direction}" if engine else direction
            ax.plot(
                positions,
                ys,
                marker="o",
                linestyle="-" if direction == "read" else "--",
                color=colors.get(engine, "C0" if direction == "read" else "C1"),
                label=label,
            )
        ax.set_xticks(positions)
        ax.set_xticklabels(
            [str(v).lower() if isinstance(v, bool) else show(param, v) for v in values]
        )
        ax.set_xlabel(param)
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle("fastckpt tune: best GB/s at each setting")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
