"""The decode engine's tables in RESULTS.md (benchmarks/make_results.py renders each results
file through its kind's function): the engine at each batch size, time inside compiled graphs,
continuous batching against lockstep, and a lone request through a streaming engine."""


def decode_section(title, data, name, description, columns):
    """The heading, the file line and the table header of a decode benchmark's section."""
    date = data["datetime"][:19].replace("T", " ")
    return [f"## {title}: {date} UTC — {data['machine']}", "",
            f"File `results/{name}`: `{data['command'].strip()}`, {description}", "",
            "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def render_engine(data, name):
    """The decode engine's table (benchmarks/decoders/record_engine.py): every method at each batch size,
    eager and compiled, speed-ups against ar in the same mode and batch size of the same run."""
    lines = decode_section(
        "Decode engine", data, name,
        f"{data['num_images']} images per cell, {data['threads']} CPU thread(s), embedded default family (16x16, "
        "CFG 2), methods taking turns. Speed-up: against `ar` in the same mode and batch size. Host round trips and "
        "ATen ops per real target pass (a batched pass counts once), counted eagerly (torch.compile does not run "
        "under the counter; a fullgraph compiled step holds no host read).",
        ["method", "batch", "mode", "s / image", "images / s", "speed-up vs ar", "target passes / image",
         "host round trips / pass", "ATen ops / pass", "compile s"])
    if data.get("stopped_early"):
        # A run cut short by a time limit (record_engine.py saves on SIGTERM): its cells without
        # timed images have compile times and round trips only.
        lines[4:4] = ["Stopped early by a time limit: a cell shows the figures it reached ('-': not timed).", ""]

    def fmt(value, spec, suffix=""):
        return "-" if value is None else f"{value:{spec}}{suffix}"

    for r in sorted(data["rows"], key=lambda r: (r["batch_size"], r["mode"] != "eager", r["method"] != "ar")):
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['mode']} | {fmt(r['s_per_image'], '.3f')} | "
                     f"{fmt(r['images_per_s'], '.2f')} | {fmt(r['speedup_vs_ar'], '.2f', 'x')} | "
                     f"{fmt(r['target_passes_per_image'], '.1f')} | {r['round_trips_per_pass']:.2f} | "
                     f"{fmt(r['aten_ops_per_pass'], '.0f')} | {r['compile_s']:.1f} |")
    return lines + [""]


CONTINUOUS_PLOT = "continuous.png"


def render_continuous(data, name):
    """Continuous batching against lockstep batches (benchmarks/decoders/record_continuous.py):
    every method at each concurrency, speed-ups against ar's lockstep batches in the same mode."""
    grid = data.get("grid", 16)
    budgets = any(r.get("max_tokens_per_pass") is not None for r in data["rows"])
    modes = ", ".join(sorted({r["mode"] for r in data["rows"]}))
    methods = sorted({r["method"] for r in data["rows"]} - {"ar"})
    some = f" ({', '.join(methods)})" if len(methods) < 6 else ""    # (a run of a few of the six methods)
    lines = decode_section(
        f"Continuous batching, {grid}x{grid}, {modes}{some}" + (", token budgets" if budgets else ""), data, name,
        f"{data['num_images']} images per cell, {data['threads']} CPU thread(s), embedded family {grid}x{grid}. "
        "Lockstep: batches of `concurrency` images run until their slowest is done; continuous: `decode(concurrency"
        "=...)`, an image's row refilled as soon as it is done (every method is a policy over the rows of "
        "one scheduler). Speed-up: against `ar` in lockstep batches at the same concurrency and "
        "mode (its best). Continuous batching has not run on a GPU yet. Target passes / image: the "
        "passes each image took part in; passes made / image: the target passes the decode made (a shared pass "
        "once), over the images.",
        ["method", "mode", "concurrency", "batching", "tokens / pass", "images / s", "speed-up vs ar",
         "target passes / image", "passes made / image", "tokens fed / image", "compile s"])
    ar = {(r["mode"], r["concurrency"]): r["images_per_s"] for r in data["rows"]
          if r["method"] == "ar" and r["batching"] == "lockstep"}
    for r in data["rows"]:
        base = ar.get((r["mode"], r["concurrency"]))
        vs = "-" if not base else f"{r['images_per_s'] / base:.2f}x"
        made = "-" if r.get("passes_made_per_image") is None else f"{r['passes_made_per_image']:.1f}"
        lines.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {r['batching']} | "
                     f"{r.get('max_tokens_per_pass') or 'no limit'} | {r['images_per_s']:.2f} | {vs} | "
                     f"{r['target_passes_per_image']:.1f} | {made} | {r['tokens_fed_per_image']:.0f} | "
                     f"{r['compile_s']:.1f} |")
    if len({r["concurrency"] for r in data["rows"]}) > 1 and modes == "compiled":   # (the plot's mode)
        lines += ["", f"![Images per second against concurrency, lockstep and continuous]({CONTINUOUS_PLOT})"]
    return lines + [""]


def render_graph_time(data, name):
    """Where a compiled decode's time goes (benchmarks/decoders/record_graph_time.py): seconds inside the
    compiled graphs and outside them, and the speed-up over compiled ar with free host work."""
    lines = decode_section(
        "Time inside compiled graphs", data, name,
        f"{data['num_images']} images per method at batch 1, compiled, {data['threads']} CPU thread(s), embedded "
        "default family, methods taking turns image by image. Graph-only ceiling: `ar`'s seconds per image over the "
        "method's seconds inside compiled graphs (its speed-up if the host work between graphs cost nothing). "
        "Tokens fed: the target's, bucket padding included (an AR step feeds one).",
        ["method", "s / image", "in graphs", "outside", "target passes / image", "tokens fed / image",
         "speed-up vs ar", "graph-only ceiling"])
    for r in data["rows"]:
        lines.append(f"| {r['method']} | {r['s_per_image']:.3f} | {r['graph_s_per_image']:.3f} "
                     f"({r['graph_share']:.0%}) | {r['host_s_per_image']:.3f} | {r['target_passes_per_image']:.1f} | "
                     f"{r['target_tokens_fed_per_image']:.0f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{r['graph_only_ceiling_vs_ar']:.2f}x |")
    return lines + [""]


def render_light_load(data, name):
    """What one request costs through a streaming engine built for many
    (benchmarks/decoders/record_light_load.py): per method, its seconds at each concurrency against
    its own at concurrency 1, and the rows its target passes fed."""
    grid = data.get("grid", 16)
    lines = decode_section(
        f"Light load, {data.get('variant') or f'{grid}x{grid}'}", data, name,
        f"requests one at a time (each submitted when the last is done), the median of {data['num_images']} per "
        f"cell, {data['threads']} CPU thread(s), embedded family {grid}x{grid}, `stream(method, concurrency=...)`. "
        "Against concurrency 1: the same method's engine of one row. Rows / target pass: the images of the cache "
        "a target pass fed, on average (the passes go over the rows that hold images, rounded up to a bucket).",
        ["method", "mode", "concurrency", "engine", "seconds / request", "vs concurrency 1",
         "target passes / request", "rows / target pass"])
    alone = {(r["method"], r["mode"]): r["latency_s"] for r in data["rows"] if r["concurrency"] == 1}
    for r in sorted(data["rows"], key=lambda r: (r["mode"], r["method"] != "ar", r["method"], r["concurrency"])):
        base = alone.get((r["method"], r["mode"]))
        vs = "-" if not base else f"{r['latency_s'] / base:.2f}x"
        lines.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {r['engine']} | {r['latency_s']:.3f} | "
                     f"{vs} | {r['target_passes']:.0f} | {r['rows_per_pass']:.1f} |")
    return lines + [""]


def render_serve(data, name):
    """`specdec serve` under load against `stream()` driven directly in one process
    (benchmarks/serve/record_serve.py): per method and concurrency, each figure as server / stream()."""
    lines = decode_section(
        "Serving", data, name,
        f"at most {data['requests']} requests per cell, Poisson arrivals at {data['rate']:g}/s from K = concurrency "
        f"clients on loopback, each streaming one partial image; {data['threads']} CPU thread(s), embedded family "
        f"16x16, {'compiled' if data.get('compile') else 'eager'}; (exact): exact mode, the widths following the "
        "load. Each cell: `specdec serve` / the same arrivals through `stream()` in one process.",
        ["method", "concurrency", "images / s", "p50 latency s", "p99 latency s", "p50 first partial s"])
    for r in data["rows"]:
        a, b = r["server"], r["stream"]

        def both(key, digits):
            return f"{a[key]:.{digits}f} / {b[key]:.{digits}f}"
        method = f"{r['method']} (exact)" if r.get("exact") else r["method"]
        lines.append(f"| {method} | {r['concurrency']} | {both('images_per_s', 2)} | {both('latency_p50_s', 2)} | "
                     f"{both('latency_p99_s', 2)} | {both('first_partial_p50_s', 2)} |")
    return lines + [""]


def render_exact(data, name):
    """Exact mode (benchmarks/decoders/record_exact.py): against the ratio test (its acceptance
    part), or with widths that follow the load (its load part), whichever parts the file holds."""
    rows = data["rows"]
    acceptance = [r for r in rows if r["part"] == "acceptance"]
    load = [r for r in rows if r["part"] == "load"]
    lines = []
    if acceptance:
        lines += decode_section(
            "Exact mode against the ratio test", data, name,
            f"{data['threads']} CPU thread(s), embedded families, compiled, `sd` and `sjd` at batch 1 with their "
            f"fixed widths, {data['num_images']} images per cell. Acceptance per judged draft its round reached (the "
            "earlier drafts kept), beside two bounds averaged over the same drafts from the same passes: exact "
            "coupling keeps a draft with probability at least (1 - TV) / (1 + TV), the ratio test at best 1 - TV "
            "(TV between the target's distribution there and the draft's). The two samplers make other images, "
            "so they judge other drafts.",
            ["grid", "method", "sampler", "acceptance", "(1 - TV) / (1 + TV)", "1 - TV", "drafts reached",
             "target passes / image", "s / image"])
        for r in acceptance:
            lines.append(f"| {r['grid']}x{r['grid']} | {r['method']} {_options(r['options'])} | "
                         f"{'exact' if r['exact'] else 'ratio test'} | {r['acceptance']:.3f} | "
                         f"{r['bound_exact']:.3f} | {r['bound_ratio']:.3f} | {r['reached']} | "
                         f"{r['target_passes']:.1f} | {r['seconds_per_image']:.3f} |")
        lines.append("")
    if load:
        lines += decode_section(
            "Exact mode, widths that follow the load", data, name,
            f"{data['threads']} CPU thread(s), embedded family 16x16, compiled, `concurrency=c`, "
            f"{data.get('load_images')} images per cell (at least c)"
            + (f", the median of {data['repeats']} rounds that time the variants in turn (the ratio: the median "
               "of each round's ratio to exact `ar`'s run in that round)" if data.get("repeats", 1) > 1
               else "") + ". Against exact `ar` at the same concurrency; "
            "same image: tokens bit-identical to exact `ar`'s (cpu backend). Adaptive: the width rule's choice each "
            "step (the default in exact mode); fixed: the options' own width (`sd` chunk 4, `sjd` window 16).",
            ["concurrency", "variant", "images / s", "vs exact ar", "target passes / image", "same image"])
        base = {r["concurrency"]: r["images_per_s"] for r in load if r["variant"] == "ar exact"}
        for r in load:
            same = {None: "-", True: "yes", False: "no"}[r["same_as_exact_ar"]]
            ratio = r.get("vs_exact_ar", r["images_per_s"] / base[r["concurrency"]])
            lines.append(f"| {r['concurrency']} | {r['variant']} | {r['images_per_s']:.2f} | {ratio:.2f}x | "
                         f"{r['target_passes']:.1f} | {same} |")
        lines.append("")
    if data.get("note"):
        lines[2:2] = [f"Run {data['note']}.", ""]
    return lines


def _options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())
