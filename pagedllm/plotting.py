"""What every picture pagedllm draws shares (`plan --plot`, `bench sweep --plot`, `bench serve --plot`): the file's
suffix names its format, and matplotlib draws it off-screen (the `bench` extra)."""
from __future__ import annotations

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(path: str) -> None:
    """A file the picture can be written to, checked before any work: its suffix names the format, and matplotlib
    is installed."""
    if not path.lower().endswith(PLOT_SUFFIXES):
        raise ValueError(f"--plot {path}: name a {', '.join(PLOT_SUFFIXES)} file (the suffix picks the format)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pagedllm[bench])") from None


def pyplot():
    """matplotlib.pyplot on its off-screen backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
