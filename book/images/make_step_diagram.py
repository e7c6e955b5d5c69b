"""Draw one mixed-precision training step as an SVG for the book's introduction.

Run from the repository root:  python book/images/make_step_diagram.py
It writes book/images/mixed_precision_step.svg (text is drawn as paths, so the figure looks the
same in every browser without fonts). Blue boxes hold fp32 tensors, orange boxes low-precision
(bf16 or fp16) ones, grey boxes are decisions and bookkeeping.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

FP32 = "#cfe2f3"       # fp32 tensors
LOW = "#fce5cd"        # bf16 / fp16 tensors
LOGIC = "#eeeeee"      # checks and bookkeeping
EDGE = "#333333"

OUT = Path(__file__).with_name("mixed_precision_step.svg")

# (x, y) centres on a 16 x 9 canvas; each box: key -> (x, y, width, height, colour, text)
BOXES = {
    "master": (2.3, 7.3, 3.6, 1.4, FP32, "fp32 master weights\n(the optimizer owns these)"),
    "cast": (6.6, 7.3, 3.4, 1.4, LOW, "cast to a bf16/fp16 copy\n(autocast, per matmul)"),
    "forward": (10.9, 7.3, 3.9, 1.6, LOW, "forward under autocast:\nmatmuls in bf16/fp16,\nsoftmax and loss in fp32"),
    "scale": (14.4, 5.3, 2.8, 1.4, FP32, "loss \u00d7 S\n(S = loss scale)"),
    "backward": (14.4, 3.1, 2.8, 1.4, LOW, "backward:\ngradients of S \u00d7 loss"),
    "unscale": (11.3, 1.3, 3.9, 1.4, FP32, "unscale: gradients \u00f7 S in fp32,\ncheck for inf / NaN"),
    "step": (6.0, 2.9, 3.4, 1.2, FP32, "all finite: optimizer step\non fp32 master weights"),
    "skip": (6.0, 0.9, 3.4, 1.0, LOGIC, "inf or NaN found:\nskip this step"),
    "update": (2.3, 3.6, 3.6, 1.6, LOGIC, "update S:\noverflow: S \u00d7 0.5\nN clean steps: S \u00d7 2"),
}

# (from, to, label, connection style)
ARROWS = [
    ("master", "cast", "", "arc3"),
    ("cast", "forward", "", "arc3"),
    ("forward", "scale", "loss (fp32)", "arc3,rad=-0.25"),
    ("scale", "backward", "", "arc3"),
    ("backward", "unscale", "", "arc3,rad=-0.25"),
    ("unscale", "step", "finite", "arc3,rad=0.15"),
    ("unscale", "skip", "overflow", "arc3,rad=-0.1"),
    ("step", "update", "", "arc3"),
    ("skip", "update", "", "arc3,rad=-0.2"),
    ("update", "master", "next step", "arc3"),
]


def _edge_point(box, toward):
    """Where the segment from a box's centre toward a point leaves the box."""
    x, y, w, h = box[:4]
    dx, dy = toward[0] - x, toward[1] - y
    if dx == 0 and dy == 0:
        return x, y
    t = min((w / 2) / abs(dx) if dx else float("inf"), (h / 2) / abs(dy) if dy else float("inf"))
    return x + dx * t, y + dy * t


def draw(path: Path = OUT) -> Path:
    plt.rcParams["svg.fonttype"] = "path"  # glyphs as outlines: no font needed in the browser
    fig, ax = plt.subplots(figsize=(12, 6.75))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 9)
    ax.axis("off")

    for x, y, w, h, colour, text in BOXES.values():
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05,rounding_size=0.15",
                                    facecolor=colour, edgecolor=EDGE, linewidth=1.2))
        ax.text(x, y, text, ha="center", va="center", fontsize=10.5)

    for start, end, label, style in ARROWS:
        a, b = BOXES[start], BOXES[end]
        p0 = _edge_point(a, b[:2])
        p1 = _edge_point(b, a[:2])
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=16, color=EDGE,
                                     linewidth=1.3, connectionstyle=style, shrinkA=2, shrinkB=2))
        if label:
            mx, my = (p0[0] + p1[0]) / 2, (p0[1] + p1[1]) / 2
            ax.text(mx, my + 0.25, label, ha="center", va="bottom", fontsize=9.5, style="italic",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1.0))

    ax.text(0.2, 8.75, "One mixed-precision training step", fontsize=13, weight="bold", va="top")
    for i, (colour, name) in enumerate([(FP32, "fp32"), (LOW, "bf16 / fp16"), (LOGIC, "control")]):
        ax.add_patch(FancyBboxPatch((9.2 + 2.2 * i, 8.5), 0.4, 0.3, boxstyle="round,pad=0.02",
                                    facecolor=colour, edgecolor=EDGE))
        ax.text(9.75 + 2.2 * i, 8.65, name, va="center", fontsize=9.5)

    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw())
