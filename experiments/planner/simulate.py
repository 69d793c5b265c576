"""Beyond this machine: the planner's cost model with ``cluster=h100_8x`` against torchtitan's
and Megatron-Bridge's published H100 runs, and its predicted scaling up to 1,024 devices.

    python experiments/planner/simulate.py           # writes simulation.json, scaling.png, README
    python experiments/planner/simulate.py --no-write

Nothing is measured here: every figure is the cost model's (``litscale.planner``) for a model
built on the meta device, on the cluster preset as shipped (``conf/cluster/h100_8x.yaml``, its
achieved fraction 0.45 assumed, not fitted to these tables).

Published figures: torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (December 2024,
torchtitan 9dec370): Llama 3.1 8B with FSDP on 8 and 128 H100s (tables 1 and 3, local batch 2,
sequence 8192, selective activation checkpointing, no torch.compile, bf16) and Llama 3.1 405B on
512 H100s, FSDP 8 x TP 8 x PP 8, 1F1B against interleaved 1F1B (table 5, local batch 32,
full activation checkpointing; with torch.compile, Float8 and async TP: predicted as
precision=fp8 would run it, its Linear layers in float8; torch.compile and async TP are not
modelled); and Megatron-Bridge's DGX-H100 rows for Llama 3 8B, Llama 3 70B and Qwen3-30B-A3B
(``megatron_bridge``), all published in FP8, predicted in BF16 and as precision=fp8.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

from study import write_section  # noqa: E402  (this folder's study.py)

from litscale.models.gpt import build_gpt  # noqa: E402
from litscale.models.llama import build_llama  # noqa: E402
from litscale.parallel.layout import MeshSizes  # noqa: E402
from litscale.planner.cost import Plan, predict  # noqa: E402
from litscale.planner.model_facts import model_facts  # noqa: E402

SOURCE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26)"
# Llama 3.1 405B (Meta's model card): 126 layers, 128 heads, 8 key/value heads, width 16384.
LLAMA_405B = {"n_layer": 126, "n_head": 128, "n_kv_heads": 8, "n_embd": 16384, "ffn_hidden_size": 53248}
DEVICES = [8, 16, 32, 64, 128, 256, 512, 1024]


def h100(nodes: int):
    cluster = OmegaConf.load(REPO / "conf" / "cluster" / "h100_8x.yaml")
    cluster.nodes = nodes
    return instantiate(cluster, _convert_="all")


def facts_of(build, seq_len: int, **net):
    with torch.device("meta"):
        return model_facts(build(**net), seq_len=seq_len, vocab_size=net.get("vocab_size", 128256))


def bf16(strategy: str, mesh: MeshSizes, micro: int, **rest) -> Plan:
    return Plan(strategy, mesh, micro, rest.pop("accumulation", 1), compute_dtype="bfloat16",
                param_dtype="bfloat16", **rest)


def published() -> list[dict]:
    """The model's figures beside torchtitan's, tokens/s per GPU and GiB per GPU."""
    llama8b = facts_of(build_llama, 8192, preset="llama3_8b", vocab_size=128256, block_size=8192)
    llama405b = facts_of(build_llama, 8192, preset="llama3_8b", vocab_size=128256, block_size=8192, **LLAMA_405B)
    rows = []
    for gpus, tps, gib, table in ((8, 5762, 82.4, 1), (128, 5605, 67.0, 3)):
        # Selective checkpointing recomputes cheap element-wise ops only: modelled as none.
        prediction = predict(bf16("fsdp", MeshSizes(data_shard=gpus), 2), llama8b, h100(gpus // 8))
        rows.append({"case": f"Llama 3.1 8B, FSDP {gpus} GPUs", "table": table, "precision": "bf16",
                     "published_tps_per_gpu": tps,
                     "published_gib": gib, **_figures(prediction, gpus)})
    for schedule, virtual, tps, gib in (("1f1b", 1, 100, 82.5), ("interleaved_1f1b", 2, 128, 72.7)):
        plan = bf16("pipeline", MeshSizes(pipeline=8, data_shard=8, tensor=8), 32, activation_checkpointing=True,
                    microbatches=32, schedule=schedule, virtual_stages=virtual)
        prediction = predict(dataclasses.replace(plan, float8=True), llama405b, h100(64))
        rows.append({"case": f"Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, {schedule}", "table": 5, "precision": "fp8",
                     "published_tps_per_gpu": tps, "published_gib": gib, **_figures(prediction, 512)})
    return rows


MEGATRON_SOURCE = ("Megatron-Bridge docs/performance-summary.md, 25.11 NeMo container, DGX-H100 rows "
                   "(NVIDIA-NeMo/Megatron-Bridge 00b7660)")
# Llama 3 70B (Meta's model card): 80 layers, 64 heads, 8 key/value heads, width 8192.
LLAMA_70B = {"n_layer": 80, "n_head": 64, "n_kv_heads": 8, "n_embd": 8192, "ffn_hidden_size": 28672}


def megatron_bridge() -> list[dict]:
    """The model's figures beside Megatron-Bridge's H100 rows, each as published (GPUs, global
    and micro batch, sequence) in the nearest layout litscale runs. Published in FP8 (current
    scaling): each row is predicted in BF16 and as precision=fp8 runs it (torchao's float8 for
    the Linear layers but the head, at the preset's FP8 peak; attention, the norms and the
    element-wise work in BF16)."""
    from litscale.models.moe import build_moe

    llama8b = facts_of(build_llama, 8192, preset="llama3_8b", vocab_size=128256, block_size=8192)
    llama70b = facts_of(build_llama, 8192, preset="llama3_8b", vocab_size=128256, block_size=8192, **LLAMA_70B)
    qwen3 = facts_of(build_moe, 4096, preset="qwen3_30b_a3b", vocab_size=151936, block_size=4096)
    cases = [
        # Megatron FSDP, MBS 1, GA 16, global batch 128: FSDP over 8, 16 accumulation steps.
        ("Llama 3 8B, 8 GPUs, FSDP 8", "FSDP 1, TP 1, PP 1, MBS 1, GA 16", 14451, 8, llama8b,
         bf16("fsdp", MeshSizes(data_shard=8), 1, accumulation=16)),
        # TP 4 x PP 8 (VP 5) x DP 2 (DDP with the distributed optimizer), MBS 1, GA 64: litscale's
        # pipeline shards its 2 data ranks with FSDP (whole parameters through the step).
        ("Llama 3 70B, 64 GPUs, TP 4 x PP 8 (VP 5) x DP 2", "FSDP 0, TP 4, PP 8, VP 5, MBS 1, GA 64", 1602, 64,
         llama70b, bf16("pipeline", MeshSizes(pipeline=8, data_shard=2, tensor=4), 64, microbatches=64,
                        schedule="interleaved_1f1b", virtual_stages=5)),
        # PP 2 (VP 24) x EP 8 x DP 8, MBS 2, GA 32: litscale's pipeline takes no expert parallel,
        # so the nearest layout it runs: FSDP over 16 with EP 8, the same micro batch and batch.
        ("Qwen3-30B-A3B, 16 GPUs, FSDP 16 x EP 8", "FSDP 0, PP 2, VP 24, EP 8, MBS 2, GA 32", 5275, 16, qwen3,
         bf16("fsdp", MeshSizes(data_shard=16, expert=8), 2, accumulation=16)),
    ]
    rows = []
    for case, layout, tps, gpus, facts, plan in cases:
        cluster = h100(gpus // 8)
        fp8 = predict(dataclasses.replace(plan, float8=True), facts, cluster)
        rows.append({"case": case, "published_layout": layout, "published_precision": "FP8-CS",
                     "published_tps_per_gpu": tps, **_figures(predict(plan, facts, cluster), gpus),
                     "predicted_tps_per_gpu_fp8": fp8.tokens_per_s / gpus,
                     "float8_flops_share": facts.float8_flops_per_token / facts.flops_per_token})
    return rows


def _figures(prediction, gpus: int) -> dict:
    return {"predicted_tps_per_gpu": prediction.tokens_per_s / gpus, "predicted_gib": prediction.peak_bytes / 2**30,
            "predicted_mfu": prediction.mfu, "bubble": prediction.bubble,
            "exposed_comm_share": prediction.exposed_comm_s / prediction.step_s}


def scaling() -> dict:
    """Weak scaling (the same batch per device) from 8 to 1,024 H100s: efficiency = the step's
    compute and optimizer time over its whole time (communication left exposed and the
    pipeline bubble are the loss), and the exposed communication's share of the step."""
    models = {
        "GPT-2 small (124M), seq 1024, 8 samples per device": (
            facts_of(build_gpt, 1024, preset="small"), 8,
            {"ddp": lambda n: MeshSizes(data_replicate=n), "fsdp": lambda n: MeshSizes(data_shard=n),
             "hsdp (replicas across nodes x fsdp 8)": lambda n: MeshSizes(data_replicate=n // 8, data_shard=8),
             "3-D (pp 2 x dp x tp 4)": lambda n: MeshSizes(pipeline=2, data_shard=n // 8, tensor=4)}),
        "Llama-3 8B, seq 8192, 1 sample per device, act. ckpt": (
            facts_of(build_llama, 8192, preset="llama3_8b", vocab_size=128256, block_size=8192), 1,
            {"ddp": lambda n: MeshSizes(data_replicate=n), "fsdp": lambda n: MeshSizes(data_shard=n),
             "hsdp (replicas across nodes x fsdp 8)": lambda n: MeshSizes(data_replicate=n // 8, data_shard=8),
             "3-D (pp 4 x dp x tp 8)": lambda n: MeshSizes(pipeline=4, data_shard=n // 32, tensor=8)}),
    }
    curves = {}
    for model, (facts, per_device, meshes) in models.items():
        for name, mesh_of in meshes.items():
            points = []
            for devices in DEVICES:
                try:
                    mesh = mesh_of(devices)
                except ValueError:  # a size the layout does not fit (3-D below its pp x tp)
                    continue
                if mesh.world_size != devices:
                    continue
                strategy = name.split(" ")[0].replace("hsdp", "fsdp").replace("3-D", "pipeline")
                # A pipeline rank takes pp x 2 samples in as many micro-batches: the same tokens
                # per device as the others, and a bubble of (pp - 1) / (3 pp - 1).
                micro = per_device * mesh.tensor * mesh.pipeline
                microbatches = 2 * mesh.pipeline if mesh.pipeline > 1 else 1
                micro = max(micro, microbatches)
                plan = bf16(strategy, mesh, micro, activation_checkpointing=per_device == 1,
                            microbatches=microbatches)
                p = predict(plan, facts, h100(devices // 8))
                useful = p.compute_s * (1 - p.bubble) + p.optimizer_s
                points.append({"devices": devices, "efficiency": useful / p.step_s,
                               "exposed_comm_share": p.exposed_comm_s / p.step_s, "bubble": p.bubble,
                               "gib_per_device": p.peak_bytes / 2**30, "fits": p.peak_bytes <= 80 * 2**30,
                               "tps_per_device": p.tokens_per_s / devices,
                               "largest_collective": max(p.collectives, key=lambda c: c.seconds).name
                               if p.collectives else None})
            curves[f"{model} | {name}"] = points
    return curves


def report(results: dict) -> str:
    lines = [f"Published figures: {SOURCE}. Cluster: `conf/cluster/h100_8x.yaml` as shipped.", "",
             "| case (table) | predicted as | published tokens/s/GPU | predicted | error | published GiB | "
             "predicted GiB |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["published"]:
        error = r["predicted_tps_per_gpu"] / r["published_tps_per_gpu"] - 1
        lines.append(f"| {r['case']} ({r['table']}) | {r['precision']} | {r['published_tps_per_gpu']:,} | "
                     f"{r['predicted_tps_per_gpu']:,.0f} | {error:+.0%} | {r['published_gib']} | "
                     f"{r['predicted_gib']:.1f} |")
    rows = {r["case"]: r for r in results["published"]}
    fsdp8, fsdp128 = (rows[f"Llama 3.1 8B, FSDP {n} GPUs"] for n in (8, 128))
    one, inter = (rows[f"Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, {s}"] for s in ("1f1b", "interleaved_1f1b"))
    lines += ["", "| comparison | published | predicted | order holds |", "| --- | ---: | ---: | --- |"]
    for label, a, b in (("8B FSDP: 128 GPUs / 8 GPUs, tokens/s per GPU", fsdp128, fsdp8),
                        ("405B: interleaved 1F1B / 1F1B", inter, one)):
        published_ratio = a["published_tps_per_gpu"] / b["published_tps_per_gpu"]
        predicted_ratio = a["predicted_tps_per_gpu"] / b["predicted_tps_per_gpu"]
        holds = (published_ratio > 1) == (predicted_ratio > 1)
        lines.append(f"| {label} | {published_ratio:.3f} | {predicted_ratio:.3f} | {'yes' if holds else '**no**'} |")
    lines += ["", f"Published figures: {MEGATRON_SOURCE}, all FP8 (current scaling); predicted in BF16, and "
              "as precision=fp8 runs it (float8 FLOPs: the float8 layers' share of the model's).", "",
              "| case (litscale's layout) | published layout | published tokens/s/GPU | predicted BF16 | error | "
              "predicted FP8 | error | float8 FLOPs | predicted GiB |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["megatron_bridge"]:
        bf16_error = r["predicted_tps_per_gpu"] / r["published_tps_per_gpu"] - 1
        fp8_error = r["predicted_tps_per_gpu_fp8"] / r["published_tps_per_gpu"] - 1
        lines.append(f"| {r['case']} | {r['published_layout']} | {r['published_tps_per_gpu']:,} | "
                     f"{r['predicted_tps_per_gpu']:,.0f} | {bf16_error:+.0%} | "
                     f"{r['predicted_tps_per_gpu_fp8']:,.0f} | {fp8_error:+.0%} | {r['float8_flops_share']:.0%} | "
                     f"{r['predicted_gib']:.1f} |")
    lines += ["", "Predicted weak scaling at 1,024 devices (efficiency: compute and optimizer time over the "
              "step; the rest is exposed communication and the pipeline bubble):", "",
              "| model, strategy | efficiency at 8 | at 1,024 | exposed comm at 1,024 | largest collective | "
              "GiB/device | fits 80 GiB |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for name, points in results["scaling"].items():
        first, last = points[0], points[-1]
        lines.append(f"| {name} | {first['efficiency']:.1%} | {last['efficiency']:.1%} | "
                     f"{last['exposed_comm_share']:.1%} | {last['largest_collective']} | "
                     f"{last['gib_per_device']:.1f} | {'yes' if last['fits'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(name.split(" | ")[0] for name in results["scaling"]))
    figure, axes = plt.subplots(2, len(models), figsize=(13, 7.5), sharex=True)
    for column, model in enumerate(models):
        for index, (name, points) in enumerate((n, p) for n, p in results["scaling"].items() if n.startswith(model)):
            label, color = name.split(" | ")[1], f"C{index}"
            devices = [p["devices"] for p in points]
            axes[0, column].plot(devices, [p["efficiency"] for p in points], marker="o", color=color, label=label)
            axes[1, column].plot(devices, [p["exposed_comm_share"] for p in points], marker="o", color=color,
                                 label=label)
            unfit = [p for p in points if not p["fits"]]
            axes[0, column].scatter([p["devices"] for p in unfit], [p["efficiency"] for p in unfit], marker="x",
                                    s=80, color="black", zorder=3)
        axes[0, column].set(title=model, ylabel="predicted scaling efficiency", ylim=(0, 1.05))
        axes[1, column].set(xscale="log", xlabel="H100s (8 per node)", ylabel="exposed communication share of a step",
                            ylim=(0, None))
        axes[1, column].set_xticks(DEVICES, [str(d) for d in DEVICES])
        axes[0, column].legend(fontsize=8)
    figure.suptitle("Planner's weak scaling on cluster=h100_8x (x: does not fit in 80 GiB)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = {"source": SOURCE, "published": published(), "megatron_bridge": megatron_bridge(),
               "scaling": scaling()}
    text = report(results)
    print(text)
    if args.no_write:
        return
    (HERE / "simulation.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, HERE / "scaling.png")
    write_section("simulation", "simulate.py", text)


if __name__ == "__main__":
    main()
