"""Real model sizes with random weights: peak memory, seconds per target pass against the number of
tokens fed, and one decode per method at batch 1.

The models are the real configurations (width, heads, KV heads, vocabularies, grids), with random
bfloat16 weights and the decoder's depth cut to `--layers` (the cut is stated in the record, with
the parameter count at full depth):

- `llamagen-xl`: LlamaGen GPT-XL class-conditional (36 layers, width 1280, 20 heads, 16,384 codes,
  1,000 classes), 24 x 24 tokens (384 px), CFG 4.0 (two rows per image), top-k 2,000;
- `janus-pro-1b`: Janus-Pro-1B (Llama: 24 layers, width 2048, 16 heads and KV heads, 102,400 text
  ids; generation head to 16,384 codes), 24 x 24, CFG 5.0; its SigLIP understanding tower, which
  generation never runs, cut to one layer;
- `glm-image`: GLM-Image's token stage (GLM: 40 layers, width 4096, 32 heads, 2 KV heads, head 128,
  168,064 text ids, a 16,512-output head cut to the 16,384 codes, M-RoPE) at 1152 x 768 px: a 19 x 13
  preview then the 36 x 24 target, no CFG, temperature 0.9, top-p 0.75; its vision tower (used only
  for image-to-image) cut to one layer.

For each model: the peak memory while it ran (CPU: the process's peak resident set, reset per
model; CUDA: torch.cuda.max_memory_allocated), the seconds of one target pass feeding N tokens
(N = 1, 8, 16, 32, 64, 256 and the whole grid: the last N positions of the grid, every earlier slot
in the cache, as late in a decode as a pass gets; with --compile the passes of the compiled runner,
padded to its bucket widths), the AR step (one token in, the next sampled), and one decode per
method at batch 1. With random weights the drafts are as good as noise: pass counts and acceptance
mean nothing here, the cost curve is the point (it turns the pass counts of trained models into
wall-clock at real size). The cost curves of every model are measured first, then the decodes, so
a run cut short keeps the curves.

    python benchmarks/decoders/record_real_size.py [--layers 2] [--models llamagen-xl,janus-pro-1b,glm-image]
        [--methods ar,sd,lantern,sjd,zipar,mulo,ssd] [--decode-models ...] [--repeats 3] [--threads 1]
    python benchmarks/decoders/record_real_size.py --device cuda --compile --layers 8     # CUDA graphs

Kept as benchmarks/results/real-size-<machine>-<stamp>.json (rendered by make_results.py). A run
stopped by SIGTERM (gpu_check.sh's step timeout) saves what it measured, marked `stopped_early`.
"""
import argparse
import ctypes
import datetime
import gc
import os
import re
import signal
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import device_description, save_record  # noqa: E402
from script_args import count, device_name, ints, names, thread_count  # noqa: E402

MODELS = ("llamagen-xl", "janus-pro-1b", "glm-image")
METHODS = ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd")
TOKENS = (1, 8, 16, 32, 64, 256)
FULL_LAYERS = {"llamagen-xl": 36, "janus-pro-1b": 24, "glm-image": 40}
K_NEIGHBOURS = 1000


class Stopped(Exception):
    """SIGTERM arrived: stop measuring and keep what was measured."""


def _stop(signum, frame):
    raise Stopped()


class _Building:
    """Modules made in bfloat16 on `device` directly (their own random initialisation, N(0, 0.02) for
    the linear and embedding weights): no float32 copy of a 9B model on the way."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self):
        self.dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        self.ctx = torch.device(self.device)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        torch.set_default_dtype(self.dtype)


def _heads(dim, width, device):
    from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig

    torch.manual_seed(1)
    with _Building(device):
        heads = SSDHeads(SSDHeadsConfig(dim, width, n_horizontal=5, n_vertical=1))
    return heads.eval().requires_grad_(False)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def build(name: str, layers: int, device):
    """(family, conditions, description): the model at its real configuration with `layers`
    decoder layers, random bf16 weights, on `device`; the family holds SSD heads (random), a
    MuLo-SD drafter (the same model on the half grid; GLM-Image: its preview) and a random
    neighbour table is made by the caller."""
    from specdec.models.family import ModelFamily
    from specdec.settings import Sampling

    torch.manual_seed(0)
    if name == "llamagen-xl":
        from specdec.models.gpt import GPTConfig, LlamaGenGPT

        def gpt(grid):
            cfg = GPTConfig(vocab_size=16384, dim=1280, n_layer=layers, n_head=20, num_classes=1000, grid_size=grid,
                            cls_token_num=1, class_dropout_prob=0.1)
            with _Building(device):
                m = LlamaGenGPT(cfg)
            with torch.no_grad():
                m.output.weight.normal_(0.0, 0.02)   # LlamaGen initialises its head to zeros: flat logits
            return m.eval().requires_grad_(False)

        target = gpt(24)
        fam = ModelFamily(target, drafter=gpt(12), ssd_heads=_heads(1280, 24, device),
                          sampling=Sampling(cfg_scale=4.0, top_k=2000))
        layer_params = _count(target.layers[0])
        conditions = dict(classes=torch.tensor([207]))
        rows = 2
    elif name == "janus-pro-1b":
        from transformers import JanusConfig, JanusForConditionalGeneration

        from specdec.models.hf import wrap

        text = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                    num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, max_position_embeddings=16384)
        config = JanusConfig(text_config=text, vision_config=dict(num_hidden_layers=1))
        with _Building(device):
            model = JanusForConditionalGeneration(config)
        model.eval().requires_grad_(False)
        ids = dict(bos_token_id=100000, pad_token_id=100002, boi_token_id=100016)
        fam = wrap(model, **ids)
        fam.drafter = wrap(model, grid=12, **ids).target
        fam.ssd_heads = _heads(2048, 24, device)
        fam.sampling = Sampling(cfg_scale=5.0)
        layer_params = _count(model.model.language_model.layers[0])
        prompt = torch.cat([torch.tensor([100000]), torch.randint(1000, 90000, (30,)), torch.tensor([100016])])
        conditions = dict(prompts=[prompt])
        rows = 2
    elif name == "glm-image":
        from transformers import GlmImageConfig, GlmImageForConditionalGeneration

        from specdec.models.hf import wrap

        text = dict(num_hidden_layers=layers, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                   partial_rotary_factor=0.5,
                                                                   mrope_section=[8, 12, 12]))
        config = GlmImageConfig(text_config=text, vision_config=dict(depth=1))
        with _Building(device):
            model = GlmImageForConditionalGeneration(config)
        model.eval().requires_grad_(False)
        fam = wrap(model, height=1152, width=768)
        fam.ssd_heads = _heads(4096, fam.target.grid[1], device)
        layer_params = _count(model.model.language_model.layers[0])
        prompt = torch.cat([torch.randint(20000, 150000, (40,)), torch.tensor([16384])])
        conditions = dict(prompts=[prompt])
        rows = 1
    else:
        raise SystemExit(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
    target = fam.target
    # The parameters built (every tower, the cut ones at their cut), and with the decoder at full
    # depth (the missing layers added, every layer alike).
    run_params = _count(target)
    desc = dict(name=name, grid=list(target.grid), layers_run=layers, layers_full=FULL_LAYERS[name],
                hidden=target.hidden_dim, codes=target.vocab_size, rows_per_image=rows,
                preview=list(fam.preview.grid) if fam.preview is not None else None,
                params_run=run_params, params_full=run_params + (FULL_LAYERS[name] - layers) * layer_params,
                sampling=str(fam.sampling))
    return fam, conditions, desc


def _memory_reset(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    try:                                      # give the memory of freed models back to the system first
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                      # resets the peak resident set (VmHWM) to the current one
    except OSError:
        pass


def _memory_peak_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 30
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 2 ** 20
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_passes(fam, conditions, args, device, entry):
    """Seconds per target pass of N tokens at the end of the grid (earlier slots in the cache), and
    the AR step; fills entry["passes"] and entry["ar_step_s"] as it goes."""
    from specdec.decoding.compiled import bucket_width, runner_for

    target = fam.target
    H, W = target.grid
    HW = H * W
    if "classes" in conditions:
        cond = conditions["classes"]
    elif fam.preview is not None:          # the target stage: the prompt, then a (random) preview
        preview = torch.randint(0, target.vocab_size, (1, *fam.preview.grid))
        cond = target.condition_on_preview(fam.preview.encode_prompts(conditions["prompts"]), preview)
    else:
        cond = target.encode_prompts(conditions["prompts"])
    runner = runner_for(target, fam.sampling, 1, None, compile=args.compile)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (1, HW), generator=g).to(device)
    with torch.no_grad():
        runner.prefill(cond)
        runner.forward(tokens[:, :HW - 1], torch.arange(HW - 1, device=device))   # a full cache before the pass
        for n in sorted({t for t in args.tokens if t < HW} | {HW}):
            pos = torch.arange(HW - n, HW, device=device)
            times = []
            for i in range(args.repeats + 1):                       # the first: warm-up (and compile)
                _sync(device)
                t0 = time.perf_counter()
                runner.forward(tokens[:, HW - n:], pos)
                _sync(device)
                if i:
                    times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            entry["passes"].append(dict(tokens=n, width=bucket_width(n) if args.compile else n, s_per_pass=s,
                                        s_per_token=s / n, repeats=args.repeats))
            print(f"  {entry['name']}: {n:5d} tokens fed  {s * 1e3:9.2f} ms/pass", flush=True)
        step = runner.token_step()
        pos = torch.full((tokens.shape[0], 1), HW - 2, device=device)
        u = torch.rand(tokens.shape[0], HW, generator=g).to(device)
        times = []
        for i in range(args.repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            step.on_grid(tokens, pos, u, reach=HW - 2)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        entry["ar_step_s"] = statistics.median(times)
        print(f"  {entry['name']}: AR step {entry['ar_step_s'] * 1e3:.2f} ms", flush=True)
    # The graphs compiled for these passes (kept with the model: the decodes reuse them) are
    # reported here, not as the first decode's compile time.
    entry["passes_compile_s"] = runner.take_compile_s() if hasattr(runner, "take_compile_s") else 0.0


def decode_each(fam, conditions, args, neighbors, entry):
    """One decode per method at batch 1 (seed 0): wall seconds, compile seconds, passes."""
    from specdec import decoding

    options = {"sd": dict(chunk=4), "lantern": dict(chunk=4, neighbors=neighbors), "zipar": dict(window=4),
               "mulo": dict(upsample="nearest", neighbors=neighbors), "ssd": dict(rounds=1)}
    for method in args.methods:
        out = decoding.decode(method, fam, conditions.get("classes"), prompts=conditions.get("prompts"),
                              seed=0, batch_size=1, compile=args.compile, **options.get(method, {}))
        s = out.stats
        compile_s = float(sum(s.compile_s))
        entry["decodes"].append(dict(method=method, wall_s=s.wall_s, compile_s=compile_s,
                                     target_passes=s.target_forwards, draft_passes=s.draft_forwards,
                                     tokens=s.tokens))
        print(f"  {entry['name']}: {method:8s} {s.wall_s:8.2f} s ({compile_s:.1f} s compiling), "
              f"{s.target_forwards} target passes, {s.draft_forwards} draft passes", flush=True)


def _built(name, args, device, record):
    """The model `name` built (its record entry made on first build, its build figures kept)."""
    _memory_reset(device)
    t0 = time.perf_counter()
    fam, conditions, desc = build(name, args.layers, device)
    entry = next((m for m in record["models"] if m["name"] == name), None)
    if entry is None:
        weights = sum(p.numel() * p.element_size() for p in fam.target.parameters())
        entry = dict(desc, build_s=time.perf_counter() - t0, passes=[], decodes=[], ar_step_s=None,
                     weights_gb=weights / 2 ** 30, peak_build_gb=_memory_peak_gb(device), peak_memory_gb=None)
        record["models"].append(entry)
        print(f"{name}: {entry['layers_run']} of {entry['layers_full']} layers, {entry['params_run'] / 1e9:.2f}B "
              f"parameters run ({entry['params_full'] / 1e9:.2f}B at full depth), grid {entry['grid']}", flush=True)
    _memory_reset(device)
    return fam, conditions, entry


def run(args, device, record):
    """Two phases, the cost curves first (a run cut short by a time limit keeps them): every
    model's passes, then every model's decodes, each model built for its phase and freed after."""
    phases = [("passes", args.models), ("decodes", [m for m in args.models if m in args.decode_models])]
    for phase, models in phases:
        for name in models:
            fam, conditions, entry = _built(name, args, device, record)
            try:
                if phase == "passes":
                    time_passes(fam, conditions, args, device, entry)
                else:
                    g = torch.Generator().manual_seed(2)
                    neighbors = torch.randint(0, fam.target.vocab_size, (fam.target.vocab_size, K_NEIGHBOURS),
                                              generator=g, dtype=torch.int32).to(device)
                    decode_each(fam, conditions, args, neighbors, entry)
            finally:
                # the peak while its passes or decodes ran (the larger of the two phases)
                entry["peak_memory_gb"] = max(entry["peak_memory_gb"] or 0.0, _memory_peak_gb(device))
                del fam
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def decode_models(text: str) -> list:
    """--decode-models: some of MODELS, or 'none' (the cost curves alone)."""
    return [] if text == "none" else names(MODELS, "model")(text)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--compile", action="store_true", help="compiled passes (CUDA graphs on CUDA)")
    p.add_argument("--layers", type=count(1), default="2", help="decoder layers run (the depth cut)")
    p.add_argument("--models", type=names(MODELS, "model"), default=",".join(MODELS))
    p.add_argument("--decode-models", type=decode_models, default=None,
                   help="models of --models that also decode once per method (default: all; none: no decodes)")
    p.add_argument("--methods", type=names(METHODS, "method"), default=",".join(METHODS))
    p.add_argument("--tokens", type=ints(1, what="token count"), default=",".join(map(str, TOKENS)),
                   help="tokens fed per timed pass (and the grid)")
    p.add_argument("--repeats", type=count(1), default="3")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="torch CPU threads (default 1 on the CPU: on a shared 2-core machine more threads wait for "
                        "each other at every op; torch's default on CUDA)")
    args = p.parse_args(argv)
    if args.decode_models is None:
        args.decode_models = args.models
    elif set(args.decode_models) - set(args.models):     # (a model that is not built would not decode)
        p.error(f"--decode-models {', '.join(sorted(set(args.decode_models) - set(args.models)))}: not in --models")
    return args


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    started = datetime.datetime.now(datetime.timezone.utc)
    record = dict(kind="specdec-real-size", datetime=started.isoformat(), machine=device_description(),
                  command="python benchmarks/decoders/record_real_size.py "
                          + " ".join(sys.argv[1:] if argv is None else argv),
                  device=str(device), compile=args.compile, dtype="bfloat16", threads=torch.get_num_threads(),
                  layers=args.layers, models=[], loadavg_1_5_15_before=list(os.getloadavg()),
                  note="random weights: pass counts and acceptance mean nothing; the seconds per pass are the point")
    signal.signal(signal.SIGTERM, _stop)
    stopped = False
    try:
        run(args, device, record)
    except Stopped:
        stopped = True
        record["stopped_early"] = True
        print("stopped by SIGTERM: saving what was measured", flush=True)
    record["loadavg_1_5_15_after"] = list(os.getloadavg())     # a shared machine: how busy it was
    save_record("real-size", started, record)
    if stopped:
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
