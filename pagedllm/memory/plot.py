"""The memory plan as a picture (`pagedllm plan --plot plan.png|.svg`): one bar of the device's memory split into
others' use, the engine's parts (weights, activation peak, runtime overhead, ..., the KV cache) and the unused
budget, with the budget line (gpu_memory_utilization) and the reclaimable page cache where it is known. A plan that
does not fit draws what it needs past the budget in a warning colour, and each fix beneath as its own bar, labelled
with its flag. matplotlib (the `bench` extra)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.memory.plan import GiB, MemoryPlan
from pagedllm.plotting import pyplot

WARNING = "#d62728"
COLOURS = {
    "used by others": "#9e9e9e", "weights": "#1f77b4", "activation peak": "#ff7f0e", "runtime overhead": "#8c564b",
    "CUDA graphs": "#e377c2", "structured outputs bitmask": "#bcbd22", "worker processes": "#7f7f7f",
    "swap space": "#17becf", "KV cache": "#2ca02c", "unused budget": "#f0f0f0",
}
COMPONENT_COLOUR = "#9467bd"


@dataclass(frozen=True)
class Segment:
    name: str
    num_bytes: int
    colour: str
    overflow: bool = False  # needed but past what the budget leaves: drawn in the warning colour


def plan_segments(plan: MemoryPlan) -> list[Segment]:
    """The plan's bar, left to right: others' use, the engine's parts, the KV cache (or, where it does not fit, the
    KV one max_model_len sequence needs, as overflow), the unused budget."""
    parts = [("used by others", plan.device.used_by_others_bytes), ("weights", plan.weight_bytes),
             ("activation peak", plan.activation_bytes), ("runtime overhead", plan.overhead_bytes),
             ("CUDA graphs", plan.graph_pool_bytes), ("structured outputs bitmask", plan.bitmask_bytes),
             ("worker processes", plan.worker_bytes), ("swap space", plan.shared_swap_bytes)]
    segments = [Segment(name, size, COLOURS[name]) for name, size in parts if size > 0]
    segments += [Segment(c.name, c.total_bytes, COMPONENT_COLOUR) for c in plan.components]
    if plan.kv_fits:
        segments.append(Segment("KV cache", plan.kv_cache_bytes, COLOURS["KV cache"]))
    else:
        segments.append(Segment("KV cache needed (one max_model_len sequence)", plan.seq_bytes, WARNING, True))
    used = sum(s.num_bytes for s in segments)
    if plan.settings.kv_cache_memory_bytes is None and plan.budget_bytes > used:
        segments.append(Segment("unused budget", plan.budget_bytes - used, COLOURS["unused budget"]))
    return segments


def plot_plan(plan: MemoryPlan, path: str, title: str | None = None) -> None:
    """Write the picture to `path` (its suffix picks the format: .png, .svg, .pdf)."""
    from matplotlib.patches import Patch

    plt = pyplot()

    fixes = plan.fixes()
    bars = [("this plan", plan)] + [(f.command, f.plan) for f in fixes if f.plan is not None]
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.55 * len(bars)))
    total = plan.device.total_bytes / GiB
    named: dict[str, str] = {}
    for row, (label, p) in enumerate(bars):
        left = 0.0
        for s in plan_segments(p):
            width = s.num_bytes / GiB
            ax.barh(row, width, left=left, color=s.colour, edgecolor="white" if not s.overflow else WARNING,
                    hatch="//" if s.overflow else None, alpha=0.55 if s.overflow else 1.0, height=0.6)
            if width > 0.06 * total and s.name != "unused budget":
                ax.text(left + width / 2, row, f"{width:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if not s.overflow else "black")
            named.setdefault(s.name, s.colour)
            left += width
        budget = p.budget_bytes / GiB
        ax.plot([budget, budget], [row - 0.42, row + 0.42], color="black", linestyle="--", linewidth=1.2)
        if left > budget and not p.fits:  # what the plan needs past its budget
            ax.barh(row, left - budget, left=budget, color="none", edgecolor=WARNING, linewidth=2, height=0.72)
        if p.device.page_cache_bytes:
            cache = p.device.page_cache_bytes / GiB
            ax.barh(row, cache, left=p.device.total_bytes / GiB - cache, color="none", edgecolor="#555555",
                    hatch="..", height=0.3)
            named.setdefault("page cache (reclaimable)", "none")
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(total, color="black", linewidth=1)
    ax.set_xlim(0, max(total, *(sum(s.num_bytes for s in plan_segments(p)) / GiB for _, p in bars)) * 1.02)
    kind = "unified" if plan.device.unified else ("GPU" if plan.device.device == "cuda" else "host")
    ax.set_xlabel(f"GiB of {plan.device.name or kind} memory ({total:.1f} GiB in all; dashed: each plan's budget, "
                  f"gpu_memory_utilization)", fontsize=8)
    verdict = "fits" if plan.fits else f"does not fit: {plan.cause}"
    ax.set_title(title or f"memory plan: {verdict}", fontsize=9, loc="left", wrap=True)
    handles = [Patch(facecolor=c if c != "none" else "white", edgecolor="#555555" if c == "none" else c,
                     hatch=".." if c == "none" else ("//" if c == WARNING else None), label=n) for n, c in named.items()]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
