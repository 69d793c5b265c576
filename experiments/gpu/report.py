"""Writes the tables of experiments/gpu/README.md (between its results markers) and
``fp8_loss.png`` from the recorded files in ``results/``: nothing in the tables is typed by hand.

    python experiments/gpu/report.py
"""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GIB = 2**30


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def tests_table() -> str:
    root = ElementTree.parse(RESULTS / "gpu-tests-first.xml").getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "skipped")}
    after = (RESULTS / "gpu-tests-after-fixes.log").read_text().strip().splitlines()[-1]
    return (f"First run of `tests/test_gpu.py` ({counts['tests']} tests): "
            f"{counts['tests'] - counts['failures'] - counts['skipped']} passed, {counts['failures']} failed "
            f"({', '.join(f'`{name}`' for name in failed)}), {counts['skipped']} skipped (needs 2 GPUs). "
            f"After the fixes, the failed cells and the tests they touch "
            f"(`-k \"fp16_mixed or offload or single_gpu_bf16\"`): {after.strip('= ')}.\n")


def throughput_rows() -> list[dict]:
    runs = load("throughput_gpt2.json")["runs"] + load("throughput_llama.json")["runs"] + [load("plain_llama.json")]
    return [run for run in runs if run.get("tokens_per_sec")]


def throughput_table() -> str:
    runs = throughput_rows()
    lines = ["| model | runner | precision | runs (tokens/s) | median tokens/s | MFU (median) | vs plain loop |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for model in ("gpt2_small", "llama_1b"):
        plain = [r["tokens_per_sec"] for r in runs if r["model"] == model and r["runner"] == "plain"]
        groups: dict[tuple, list[dict]] = {}
        for run in runs:
            if run["model"] == model:
                groups.setdefault((run["runner"], " ".join(run.get("extra") or []) or "bf16_mixed"), []).append(run)
        for (runner, precision), group in groups.items():
            speeds = [r["tokens_per_sec"] for r in group]
            mfu = statistics.median(r["mfu"] for r in group)
            ratio = f"{statistics.median(speeds) / statistics.median(plain):.3f}" if plain else "-"
            lines.append(f"| {model} | {runner} | {precision.replace('precision=', '')} | "
                         f"{', '.join(f'{s:,.0f}' for s in speeds)} | {statistics.median(speeds):,.0f} | "
                         f"{100 * mfu:.1f}% | {ratio} |")
    return "\n".join(lines) + "\n"


def memory_table() -> str:
    memory = load("memory.json")
    lines = ["| model | strategy | micro batch | params | grads | optimizer | predicted states | peak "
             "(max allocated) | predicted peak |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in memory["strategies"]:
        if "error" in row:
            continue
        lines.append(f"| {row['model']} | {row['strategy']} | {row['micro_batch']} | " + " | ".join(
            f"{row[k] / GIB:.2f} GiB" for k in ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes",
                                                "plan/predicted_states_bytes", "memory/peak_bytes",
                                                "plan/predicted_peak_bytes")) + " |")
    lines += ["", "| model | largest micro batch that fits (doubling) | first that fails | planner's predicted largest |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['largest_fitting']} | {r['first_failing']} ({r['failure']}) | "
              f"{r['planner_predicted_largest']} |" for r in memory["largest_micro_batch"] if r["largest_fitting"]]
    return "\n".join(lines) + "\n"


def plot_fp8_loss(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in load("throughput_gpt2.json")["runs"]:
        if run["runner"] == "litscale" and run.get("losses"):
            label = " ".join(run["extra"]).replace("precision=", "").replace(" precision.float8=", " ") or "bf16_mixed"
            steps, losses = zip(*run["losses"], strict=True)
            ax.plot(steps, losses, marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("GPT-2 small on one H100: float8 vs bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    readme = HERE / "README.md"
    begin, end = "<!-- results: written by report.py -->", "<!-- end results -->"
    block = (f"{begin}\n### Tests\n\n{tests_table()}\n### Throughput\n\n{throughput_table()}\n"
             f"### Memory\n\n{memory_table()}{end}")
    head, _, rest = readme.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(head + block + tail)
    plot_fp8_loss(HERE / "fp8_loss.png")


if __name__ == "__main__":
    main()
