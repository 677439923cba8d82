"""The plots beside RESULTS.md (make_results.py writes them): the decoders' end-to-end run and
the target passes saved by grid. Both need matplotlib (requirements-dev.txt)."""


def draw(name, make) -> None:
    """Draw one figure (`make()` returns what it wrote), or say that matplotlib is missing."""
    try:
        print(f"wrote {make()}")
    except ImportError:
        print(f"matplotlib is not installed: {name} not regenerated (pip install -r requirements-dev.txt)")


def plot_compare(data, name, out_path):
    """Two panels, one point per method: target passes / image and wall-clock speed-up against
    `ar`, each over FD-classifier (log scale; lower is better), AR's FD as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    rows = data["rows"]
    ar_fd = next(r["fd"] for r in rows if r["method"] == "ar")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), dpi=100)
    panels = [("target_forwards", "target passes / image", "fewer is better"),
              ("speedup", "wall-clock speed-up vs ar", "higher is better")]
    fds = [r["fd"] for r in rows]
    ticks = [t for t in (50, 75, 100, 150, 200, 300, 400, 600, 800) if min(fds) / 1.2 <= t <= max(fds) * 1.2]
    for ax, (key, label, better) in zip(axes, panels):
        for r in rows:
            ax.scatter(r["fd"], r[key], s=36, color="tab:red" if r["method"] == "ar" else "tab:blue", zorder=3)
            ax.annotate(r["method"], (r["fd"], r[key]), textcoords="offset points", xytext=(5, 4), fontsize=9)
        ax.axvline(ar_fd, color="gray", linestyle="--", linewidth=1, zorder=1)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("FD-classifier (lower is better; dashed: ar)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} ({better})", fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax, (key, _, _) in zip(axes, panels):
        ax.set_ylim(0 if key == "target_forwards" else None, max(r[key] for r in rows) * 1.12)
    axes[1].axhline(1.0, color="gray", linestyle=":", linewidth=1, zorder=1)
    date = data["datetime"][:16].replace("T", " ")
    fig.suptitle(f"Decoders on the embedded family, {data['num_images']} images per method\n"
                 f"{data['machine']}, {date} UTC, results/{name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def plot_scaling(data, out_path):
    """The pass ratio against ar of every method by grid side (log scale), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    by_method = {}
    for r in data["rows"]:
        if r["mode"] == "eager" or not any(o["mode"] == "eager" for o in data["rows"]):
            by_method.setdefault(r["method"], {})[r["grid"]] = r["pass_ratio_vs_ar"]
    for method, points in sorted(by_method.items()):
        grids = sorted(points)
        ax.plot(grids, [points[g] for g in grids], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    grids = sorted({r["grid"] for r in data["rows"]})
    ax.set_xticks(grids, [f"{g}x{g}" for g in grids])
    ax.set_xlabel("token grid")
    ax.set_ylabel("target passes of ar / of the method")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    date = data["datetime"][:16].replace("T", " ")
    ax.set_title(f"Fewer target passes at higher resolution\n{data['machine']}, {date} UTC", fontsize=9)
    return _save(fig, out_path)


def plot_continuous(data, out_path):
    """Images per second against concurrency, one colour per method: continuous batching solid,
    lockstep batches dashed (one mode: the first in the file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = data["rows"][0]["mode"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    lines = {}
    for r in data["rows"]:
        if r["mode"] == mode and r.get("max_tokens_per_pass") is None:    # (runs without a token budget)
            lines.setdefault((r["method"], r["batching"]), {})[r["concurrency"]] = r["images_per_s"]
    colours = {}
    for (method, batching), points in sorted(lines.items()):
        xs = sorted(points)
        colour = colours.setdefault(method, f"C{len(colours)}")
        ax.plot(xs, [points[x] for x in xs], marker="o", color=colour, linestyle="-" if batching == "continuous"
                else "--", label=f"{method} {batching}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (images decoded at once)")
    ax.set_ylabel("images / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    date = data["datetime"][:16].replace("T", " ")
    ax.set_title(f"{data['machine']}, {mode}, {date}", fontsize=8)
    return _save(fig, out_path)


def _save(fig, out_path):
    """Lay the figure out, write it and free it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
