"""Llama + shipped BPE vs byte-level GPT-nano at equal training FLOPs on CPU, and the BPE
tokenizer's throughput against the ``tokenizers`` library's own batch encode.

    python experiments/llm/study.py                        # 4 configurations x 3 seeds + tokenizer
    python experiments/llm/study.py --quick                # smoke test (8 steps, 1 seed), writes nothing
    python experiments/llm/study.py --report-only          # README table and plot from results.json

The FLOP budget is the one of ``python train.py model=llama data=tokens data.tokenizer=bpe
trainer.max_steps=300``: every other configuration trains for the number of steps that spends
the same training FLOPs (steps x global batch x seq_len x the model's ``flops_per_token``).
Validation runs on the whole held-out split every ``steps / --evals`` steps, the last at the
final step, so ``val/bpb`` is from the end of training and covers all the held-out text.

Writes ``results.json``, ``bpb_vs_flops.png`` and the results section of ``README.md`` here.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

# The done-when command of the issue; its training FLOPs are every configuration's budget.
BUDGET_CONFIG = "llama_bpe"
CONFIGS: dict[str, dict] = {
    "llama_bpe": {
        "label": "Llama tiny, BPE 4k, data=tokens",
        "overrides": ["model=llama", "data=tokens", "data.tokenizer=bpe"],
        "net": ("llama", {"preset": "tiny"}), "vocab": "bpe",
    },
    "gpt_byte_default": {
        "label": "GPT-nano, bytes, data=stdlib_code (default run)",
        "overrides": [],
        "net": ("gpt", {"preset": "nano"}), "vocab": 256,
    },
    "gpt_byte_tokens": {
        "label": "GPT-nano, bytes, data=tokens (same held-out text)",
        "overrides": ["model=gpt", "data=tokens", "data.tokenizer=byte"],
        "net": ("gpt", {"preset": "nano"}), "vocab": "byte",
    },
    "llama4_bpe": {
        "label": "Llama tiny with 4 layers (GPT-nano's body), BPE 4k, data=tokens",
        "overrides": ["model=llama", "data=tokens", "data.tokenizer=bpe", "+model.net.n_layer=4"],
        "net": ("llama", {"preset": "tiny", "n_layer": 4}), "vocab": "bpe",
    },
}
# The defaults of conf/data/*.yaml, which every configuration keeps.
SEQ_LEN, MICRO_BATCH = 128, 16
# Added to every run: CPU, no progress bar, the whole held-out split at every validation, no
# checkpoint files (they change nothing trained or measured here).
COMMON = ["trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
          "callbacks.model_checkpoint.save_top_k=0", "callbacks.model_checkpoint.save_last=false"]
MB = 1e6  # tokenizer throughput is in MB (10^6 bytes) of UTF-8 text per second


# --- models and FLOPs ------------------------------------------------------------------------


def build_net(config: dict):
    from litscale.data.tokenizer import load_tokenizer
    from litscale.models.gpt import build_gpt
    from litscale.models.llama import build_llama

    kind, arguments = config["net"]
    vocab = config["vocab"]
    vocab_size = vocab if isinstance(vocab, int) else load_tokenizer(vocab).vocab_size
    builder = build_llama if kind == "llama" else build_gpt
    return builder(**arguments, vocab_size=vocab_size, block_size=SEQ_LEN)


def model_facts(config: dict) -> dict:
    """Parameters with and without the embedding tables (the token table, and GPT's position
    table: lookups, no matmul FLOPs; the output head is counted), and training FLOPs per token."""
    from torch import nn

    net = build_net(config)
    total = sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())
    embeddings = sum(m.weight.numel() for m in net.modules() if isinstance(m, nn.Embedding))
    head = net.lm_head.weight.numel()
    return {"params": total, "params_without_embeddings": total - embeddings,
            "params_body": total - embeddings - head, "output_head_params": head,
            "vocab_size": net.config.vocab_size, "n_layer": net.config.n_layer,
            "flops_per_token": float(net.flops_per_token(SEQ_LEN))}


def plan(configs: list[str], budget_steps: int, evals: int) -> dict[str, dict]:
    """Steps per configuration for equal training FLOPs, rounded to a multiple of ``evals`` so
    the last validation falls on the last step."""
    facts = {name: model_facts(CONFIGS[name]) for name in dict.fromkeys([BUDGET_CONFIG, *configs])}
    tokens_per_step = MICRO_BATCH * SEQ_LEN
    budget = budget_steps * tokens_per_step * facts[BUDGET_CONFIG]["flops_per_token"]
    planned = {}
    for name in configs:
        per_step = tokens_per_step * facts[name]["flops_per_token"]
        steps = budget_steps if name == BUDGET_CONFIG else evals * max(1, round(budget / per_step / evals))
        planned[name] = {**facts[name], "steps": steps, "val_check_interval": steps // evals,
                         "train_flops": steps * per_step, "flops_vs_budget": steps * per_step / budget,
                         "tokens_per_step": tokens_per_step}
    return planned


# --- training runs ---------------------------------------------------------------------------


def overrides_of(name: str, steps: int, interval: int, seed: int, val_batches: str) -> list[str]:
    return [*CONFIGS[name]["overrides"], f"trainer.max_steps={steps}", f"seed={seed}", *COMMON,
            f"trainer.val_check_interval={interval}", f"trainer.limit_val_batches={val_batches}"]


def train(name: str, seed: int, planned: dict, val_batches: str, outputs: Path) -> dict:
    overrides = [*overrides_of(name, planned["steps"], planned["val_check_interval"], seed, val_batches),
                 f"name={name}-seed{seed}"]
    command = "python train.py " + " ".join(overrides)
    print(f"$ {command}", flush=True)
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    process = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - started
    if process.returncode:
        raise RuntimeError(f"{name} seed {seed} failed:\n{process.stdout[-2000:]}\n{process.stderr[-3000:]}")
    summary = json.loads(next((outputs / f"{name}-seed{seed}").glob("runs/*/summary.json")).read_text())
    rows = list(csv.DictReader((Path(summary["output_dir"]) / "csv" / "metrics.csv").open()))
    return {"summary": summary, "rows": rows, "command": command, "process_wall_s": elapsed}


def train_bytes_per_token(tokenizer: str) -> float:
    """UTF-8 bytes of text per token over the training split of ``data=tokens`` (end-of-text
    tokens counted), which turns tokens/s into bytes of text/s."""
    import numpy as np

    from litscale.data.token_cache import load_cache
    from litscale.data.tokens import TokenDataModule

    data = TokenDataModule(seq_len=SEQ_LEN, batch_size=MICRO_BATCH, tokenizer=tokenizer)
    data.setup()
    cache = load_cache(data.cache_stem())
    starts = cache.starts[:-1]
    in_train = np.zeros(len(starts), dtype=bool)
    for start, end in data.train_dataset.ranges:  # whole documents, coalesced
        in_train |= (starts >= start) & (starts < end)
    return float(cache.text_bytes[in_train].sum()) / data.train_dataset.num_tokens


def run_figures(run: dict, planned: dict) -> dict:
    summary = run["summary"]
    bytes_per_token_val = summary.get("data", {}).get("val_bytes_per_token", 1.0)
    flops_per_step = planned["tokens_per_step"] * planned["flops_per_token"]
    curve = [(0, 0.0, summary["val/loss_initial"] / math.log(2) / bytes_per_token_val)]
    for row in run["rows"]:
        if row.get("val/bpb"):
            # Lightning logs a validation inside training at the step before the optimizer
            # steps done: the one after step 75 is logged at 74.
            step = int(row["step"]) + 1
            curve.append((step, step * flops_per_step, float(row["val/bpb"])))
    curve.sort()
    if curve[-1][0] != summary["steps"]:
        raise RuntimeError(f"{run['command']}: the last validation is at step {curve[-1][0]}, "
                           f"not at the last step {summary['steps']}")
    return {
        "val_bpb": summary["val/bpb"], "val_loss": summary["val/loss"],
        "val_bpb_initial": curve[0][2], "train_loss": summary.get("train/loss"),
        "tokens_per_sec": summary.get("perf/tokens_per_sec"),
        "mfu": summary.get("perf/mfu"), "tflops": summary.get("perf/tflops"),
        "step_time_s": summary.get("perf/step_time_s"),
        "flops_per_token_measured": (summary["perf/tflops"] * 1e12 / summary["perf/tokens_per_sec"]
                                     if summary.get("perf/tokens_per_sec") else None),
        "steps": summary["steps"], "train_flops": summary["steps"] * flops_per_step,
        "wall_time_s": summary["wall_time_s"], "process_wall_s": run["process_wall_s"],
        "num_params": summary["num_params"], "val_bytes_per_token": bytes_per_token_val,
        "data": summary.get("data"), "curve": curve, "command": run["command"],
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def training_study(configs: list[str], seeds: list[int], planned: dict[str, dict], val_batches: str,
                   runs_dir: Path | None) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as scratch:
        outputs = runs_dir or Path(scratch)
        if runs_dir:
            shutil.rmtree(runs_dir, ignore_errors=True)
        runs = {(name, seed): train(name, seed, planned[name], val_batches, outputs)
                for seed in seeds for name in configs}  # seed-major: a slow spell hits all alike
    bytes_per_token_train = {"byte": None, "bpe": None}
    table = {}
    for name in configs:
        per_seed = [run_figures(runs[name, seed], planned[name]) for seed in seeds]
        tokenizer = (per_seed[0]["data"] or {}).get("tokenizer")
        if tokenizer and bytes_per_token_train.get(tokenizer) is None:
            bytes_per_token_train[tokenizer] = train_bytes_per_token(tokenizer)
        train_bpt = bytes_per_token_train.get(tokenizer) or 1.0  # stdlib_code: one byte a token
        for figures in per_seed:
            figures["train_bytes_per_token"] = train_bpt
            figures["text_bytes_per_sec"] = (figures["tokens_per_sec"] or 0.0) * train_bpt
        medians = {key: _median([r[key] for r in per_seed])
                   for key in ("val_bpb", "val_loss", "val_bpb_initial", "tokens_per_sec",
                               "text_bytes_per_sec", "mfu", "tflops",
                               "step_time_s", "wall_time_s", "process_wall_s",
                               "flops_per_token_measured")}
        table[name] = {"label": CONFIGS[name]["label"], "seeds": seeds, **planned[name],
                       "median": medians, "val_bpb_per_seed": [r["val_bpb"] for r in per_seed],
                       "runs": per_seed}
    return table


# --- tokenizer throughput --------------------------------------------------------------------


def tokenizer_study(repeats: int) -> dict:
    """MB/s of the built-in corpus through litscale's ``data=tokens`` tokenizing path and
    through the ``tokenizers`` library directly, alternating the order every repeat."""
    import numpy as np
    from tokenizers import Tokenizer

    from litscale.data.documents import corpus_files, read_documents
    from litscale.data.token_cache import build_cache
    from litscale.data.tokenizer import BPE_ASSET, load_tokenizer

    files = corpus_files(None)
    texts = [text for text, _ in read_documents(files, "text") if text]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    file_bytes = sum(os.path.getsize(f) for f in files)
    bpe, byte = load_tokenizer("bpe"), load_tokenizer("byte")
    library = Tokenizer.from_file(str(BPE_ASSET))

    def pipeline(tokenizer):
        def run(scratch: Path) -> None:
            stem = str(scratch / f"tokens-{tokenizer.name}-{time.perf_counter_ns()}")
            build_cache(stem, read_documents(files, "text"), tokenizer, total_bytes=file_bytes,
                        source="the standard library")
            for suffix in (".bin", ".index.npz"):
                os.remove(stem + suffix)
        return run

    methods = {
        "litscale data=tokens pipeline, bpe": pipeline(bpe),
        "litscale tokenizer.encode_batch, bpe": lambda _: bpe.encode_batch(texts),
        "tokenizers Tokenizer.encode_batch": lambda _: library.encode_batch(texts),
        "tokenizers Tokenizer.encode_batch_fast": lambda _: library.encode_batch_fast(texts),
        "litscale data=tokens pipeline, byte": pipeline(byte),
        "litscale tokenizer.encode_batch, byte": lambda _: byte.encode_batch(texts),
    }
    # The same ids either way (the library's encode_batch with its default special tokens).
    ours = bpe.encode_batch(texts)
    theirs = library.encode_batch(texts)
    identical = all(np.array_equal(a, np.asarray(b.ids)) for a, b in zip(ours, theirs, strict=True))
    num_tokens = sum(len(a) for a in ours)
    del ours, theirs
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:  # a different one goes first every repeat
                gc.collect()
                started = time.perf_counter()
                result = methods[name](Path(scratch))
                seconds[name].append(time.perf_counter() - started)
                del result
            print(f"tokenizer repeat {repeat + 1}/{repeats}: " + ", ".join(
                f"{name} {text_bytes / MB / s[-1]:.2f} MB/s" for name, s in seconds.items()), flush=True)
    rows = {name: {"seconds": s, "mb_per_sec": [text_bytes / MB / t for t in s],
                   "median_mb_per_sec": statistics.median(text_bytes / MB / t for t in s)}
            for name, s in seconds.items()}
    reference = rows["tokenizers Tokenizer.encode_batch"]["median_mb_per_sec"]
    for row in rows.values():
        row["vs_tokenizers_encode_batch"] = row["median_mb_per_sec"] / reference
    import tokenizers

    return {"documents": len(texts), "text_bytes": text_bytes, "bpe_tokens": num_tokens,
            "bytes_per_token": text_bytes / num_tokens, "identical_ids": identical,
            "repeats": repeats, "tokenizers_version": tokenizers.__version__,
            "rayon_threads": os.environ.get("RAYON_NUM_THREADS", f"default ({os.cpu_count()} cores)"),
            "methods": rows}


# --- report ----------------------------------------------------------------------------------


def machine() -> dict:
    import lightning
    import torch

    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "torch_threads": torch.get_num_threads(),
            "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "lightning": lightning.__version__}


def probe_peak() -> float:
    """Best of 5 one-second runs of litscale's matmul probe (512-square fp32 matmuls)."""
    import torch

    from litscale.measure.flops import probe_matmul_flops

    return max(probe_matmul_flops(torch.float32, seconds=1.0) for _ in range(5))


def cached_peak() -> dict:
    """The CPU peak that litscale's ``perf/mfu`` divides by: its matmul probe, run once per CPU
    model and thread count and cached (a probe run while the machine was busy is too low)."""
    import torch

    from litscale.measure.flops import measured_cpu_peak

    threads = torch.get_num_threads()
    return {"threads": threads, "litscale_cached": measured_cpu_peak(torch.float32, threads)}


def add_probed_mfu(table: dict[str, dict], peak: float) -> None:
    for r in table.values():
        for figures in r["runs"]:
            figures["mfu_vs_probe"] = figures["tflops"] * 1e12 / peak if figures["tflops"] else None
        r["median"]["mfu_vs_probe"] = _median([f["mfu_vs_probe"] for f in r["runs"]])


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def verdict(results: dict) -> list[str]:
    table = results.get("training", {})
    if BUDGET_CONFIG not in table:
        return []
    llama = table[BUDGET_CONFIG]["median"]["val_bpb"]
    steps = table[BUDGET_CONFIG]["steps"]
    lines = []
    for name, what in (("gpt_byte_default", "the byte-level GPT's default run (`data=stdlib_code`, "
                                            "its own held-out text)"),
                       ("gpt_byte_tokens", "the byte-level GPT on the same held-out documents "
                                           "(`data=tokens data.tokenizer=byte`)")):
        if name not in table:
            continue
        other = table[name]["median"]["val_bpb"]
        below = llama < other
        lines.append(
            f"- Llama + BPE ({steps} steps) ends at **{llama:.3f}** bits per byte, "
            f"{'**below**' if below else '**not below**'} {what} at {other:.3f} after "
            f"{table[name]['steps']} steps at equal FLOPs: {abs(other - llama):.3f} bits per byte "
            f"{'lower' if below else 'higher'} ({_pct(llama / other - 1)}); seeds "
            f"{', '.join(f'{v:.3f}' for v in table[BUDGET_CONFIG]['val_bpb_per_seed'])} vs "
            f"{', '.join(f'{v:.3f}' for v in table[name]['val_bpb_per_seed'])}.")
    if "llama4_bpe" in table:
        deep = table["llama4_bpe"]["median"]["val_bpb"]
        lines.append(f"- With GPT-nano's 4-layer body instead of 2 (fewer steps for the same FLOPs) "
                     f"Llama + BPE ends at {deep:.3f} ({_pct(deep / llama - 1)} against 2 layers).")
    return lines


def report(results: dict) -> str:
    m = results["machine"]
    lines = [f"Recorded {results['date']} with `{results['command']}`: {m['cores']} cores ({m['cpu']}), "
             f"{m['torch_threads']} torch threads, {m['system']}, Python {m['python']}, torch {m['torch']}, "
             f"lightning {m['lightning']}; the machine was shared with other jobs, so throughput "
             f"figures are indicative. Study wall time {results['wall_time_s'] / 60:.0f} min.", ""]
    table = results.get("training")
    if table:
        budget = table[BUDGET_CONFIG] if BUDGET_CONFIG in table else next(iter(table.values()))
        lines += [
            f"### Equal training FLOPs: {budget['train_flops']:.3g} FLOPs, seeds {budget['seeds']}", "",
            *verdict(results), "",
            "| configuration | params (without embeddings) | FLOPs/token | steps | training FLOPs "
            "| val bpb (median) | val bpb per seed | val loss (nats/token) | held-out bytes/token "
            "| tokens/s | text bytes/s | MFU (litscale) | MFU (probed peak) | command wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in table.values():
            med = r["median"]
            lines.append(
                f"| {r['label']} | {r['params'] / 1e6:.3f}M ({r['params_without_embeddings'] / 1e6:.3f}M) "
                f"| {r['flops_per_token'] / 1e6:.2f}M | {r['steps']} | {r['train_flops']:.3g} "
                f"({_pct(r['flops_vs_budget'] - 1)}) | **{med['val_bpb']:.3f}** "
                f"| {' / '.join(f'{v:.3f}' for v in r['val_bpb_per_seed'])} | {med['val_loss']:.3f} "
                f"| {r['runs'][0]['val_bytes_per_token']:.3f} | {med['tokens_per_sec']:,.0f} "
                f"| {med['text_bytes_per_sec']:,.0f} | {100 * med['mfu']:.1f}% "
                f"| {100 * med['mfu_vs_probe']:.1f}% | {med['process_wall_s']:.0f} |")
        peaks = results["cpu_peak_flops"]
        lines += ["", f"MFU (litscale) is `perf/mfu`, against the CPU peak litscale had cached for "
                  f"{peaks['threads']} threads: {peaks['litscale_cached'] / 1e9:.1f} GFLOP/s. MFU (probed "
                  f"peak) divides by the best of 5 one-second runs of the same matmul probe before "
                  f"and after the training runs: {peaks['probed'] / 1e9:.1f} GFLOP/s (before "
                  f"{peaks['probed_before'] / 1e9:.1f}, after {peaks['probed_after'] / 1e9:.1f}). "
                  "Medians over seeds; tokens/s, bytes/s and "
                  "MFU are steady state, validation excluded; command wall s is the whole `train.py` "
                  f"command, start-up and {results['evals'] + 1} validations (the pre-training pass "
                  "included) included."]
        lines += ["", "Parameters, FLOPs per token (training, seq_len 128) and the split of the "
                  "non-embedding count:", "",
                  "| configuration | layers | vocab | params | without embeddings | of which output head "
                  "| transformer body |", "|---|---|---|---|---|---|---|"]
        for r in table.values():
            lines.append(f"| {r['label']} | {r['n_layer']} | {r['vocab_size']} | {r['params']:,} "
                         f"| {r['params_without_embeddings']:,} | {r['output_head_params']:,} "
                         f"| {r['params_body']:,} |")
        lines += ["", "Commands (seed 0; seeds 1 and 2 differ only in `seed=`):", "", "```bash"]
        lines += [r["runs"][0]["command"] for r in table.values()]
        lines += ["```", "", "![val bpb vs training FLOPs](bpb_vs_flops.png)", ""]
    tok = results.get("tokenizer")
    if tok:
        lines += [f"### Tokenizer throughput: the built-in corpus, {tok['documents']} documents, "
                  f"{tok['text_bytes'] / MB:.1f} MB of text, median of {tok['repeats']} alternated repeats",
                  "", f"BPE: {tok['bpe_tokens']:,} tokens, {tok['bytes_per_token']:.2f} bytes per token; "
                  f"litscale's ids {'are identical to' if tok['identical_ids'] else '**differ from**'} "
                  f"`Tokenizer.encode_batch`'s. tokenizers {tok['tokenizers_version']}, "
                  f"its thread pool: {tok['rayon_threads']}.", "",
                  "| path | MB/s (median) | MB/s per repeat | vs `tokenizers` `encode_batch` |",
                  "|---|---|---|---|"]
        for name, row in tok["methods"].items():
            lines.append(f"| {name} | {row['median_mb_per_sec']:.2f} "
                         f"| {' / '.join(f'{v:.2f}' for v in row['mb_per_sec'])} "
                         f"| {row['vs_tokenizers_encode_batch']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = (HERE / "README.md").read_text()
    start, end = "<!-- results: written by study.py -->", "<!-- end results -->"
    if start in readme and end in readme:
        before, rest = readme.split(start, 1)
        after = rest.split(end, 1)[1]
        (HERE / "README.md").write_text(f"{before}{start}\n{text}{end}{after}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["training"]
    figure, axis = plt.subplots(figsize=(8, 5))
    for index, r in enumerate(table.values()):
        color = f"C{index}"
        curves = [run["curve"] for run in r["runs"]]
        for curve in curves:
            axis.plot([c[1] for c in curve], [c[2] for c in curve], color=color, alpha=0.25, lw=0.8)
        length = min(len(c) for c in curves)
        axis.plot([curves[0][i][1] for i in range(length)],
                  [statistics.median(c[i][2] for c in curves) for i in range(length)],
                  color=color, marker="o", label=f"{r['label']}, {r['steps']} steps")
    axis.set_xlabel("training FLOPs (steps x 2048 tokens x FLOPs per token)")
    axis.set_ylabel("val bits per byte (median of seeds; faint: each seed)")
    axis.set_ylim(top=min(9.0, axis.get_ylim()[1]))
    axis.set_title("Llama + BPE vs byte-level GPT-nano at equal training FLOPs (CPU)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget-steps", type=int, default=300,
                        help="steps of the Llama + BPE run, whose FLOPs every configuration spends")
    parser.add_argument("--evals", type=int, default=4, help="validations per run, the last at its last step")
    parser.add_argument("--val-batches", default="1.0",
                        help="trainer.limit_val_batches: 1.0 is the whole held-out split")
    parser.add_argument("--tokenizer-repeats", type=int, default=5)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-tokenizer", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 8 budget steps, 2 validations of 4 batches, seed 0, 1 tokenizer "
                             "repeat; writes nothing")
    parser.add_argument("--runs-dir", type=Path, help="keep the run dirs here (default: a temporary dir)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the README section and plot from results.json, running nothing")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)
    if args.report_only:
        results = json.loads((HERE / "results.json").read_text())
        write_readme(report(results))
        if results.get("training"):
            plot(results, HERE / "bpb_vs_flops.png")
        return
    if args.quick:
        args.budget_steps, args.evals, args.val_batches = 8, 2, "4"
        args.seeds, args.tokenizer_repeats, args.no_write = [0], 1, True
    if args.budget_steps % args.evals:
        parser.error(f"--budget-steps {args.budget_steps} must be a multiple of --evals {args.evals}: "
                     "the last validation is at the last step")
    command = "python experiments/llm/study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.time()
    results: dict = {"command": command.strip(), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                     "budget_steps": args.budget_steps, "evals": args.evals, "val_batches": args.val_batches,
                     "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "common_overrides": COMMON}
    if not args.skip_training:
        planned = plan(args.configs, args.budget_steps, args.evals)
        for name, p in planned.items():
            print(f"{name}: {p['steps']} steps, {p['train_flops']:.4g} FLOPs "
                  f"({_pct(p['flops_vs_budget'] - 1)} vs budget)", flush=True)
        peaks = {**cached_peak(), "probed_before": probe_peak()}
        results["training"] = training_study(args.configs, args.seeds, planned, args.val_batches,
                                             args.runs_dir)
        peaks["probed_after"] = probe_peak()
        peaks["probed"] = max(peaks["probed_before"], peaks["probed_after"])
        results["cpu_peak_flops"] = peaks
        add_probed_mfu(results["training"], peaks["probed"])
    if not args.skip_tokenizer:
        results["tokenizer"] = tokenizer_study(args.tokenizer_repeats)
    results["wall_time_s"] = time.time() - started
    text = report(results)
    print(text)
    if args.no_write:
        return
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_readme(text)
    if results.get("training"):
        plot(results, HERE / "bpb_vs_flops.png")


if __name__ == "__main__":
    main()
