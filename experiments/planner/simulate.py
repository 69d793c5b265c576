"""Beyond this machine: the planner's cost model against published H100 runs (the anchors'
table, ``anchors.py``, from ``anchors.json``) and its predicted scaling up to 1,024 devices.

    python experiments/planner/simulate.py           # writes simulation.json, anchors_facts.json, scaling.png, README
    python experiments/planner/simulate.py --no-write

Nothing is measured here: every figure is the cost model's (``litscale.planner``) for a model
built on the meta device, on the cluster preset as shipped (``conf/cluster/h100_8x.yaml``, its
achieved fraction 0.45 assumed, not fitted to these tables), or with a published run's own
hardware figures where its source states them (``anchors.json``: ``clusters``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

import anchors  # noqa: E402  (this folder's anchors.py)
from study import write_section  # noqa: E402  (this folder's study.py)

from litscale.models.gpt import build_gpt  # noqa: E402
from litscale.models.llama import build_llama  # noqa: E402
from litscale.parallel.layout import MeshSizes  # noqa: E402
from litscale.planner.cost import Plan, predict  # noqa: E402
from litscale.planner.model_facts import model_facts  # noqa: E402

DEVICES = [8, 16, 32, 64, 128, 256, 512, 1024]


def h100(nodes: int):
    return anchors.cluster_of({"file": "conf/cluster/h100_8x.yaml"}, nodes * 8)


def facts_of(build, seq_len: int, **net):
    with torch.device("meta"):
        return model_facts(build(**net), seq_len=seq_len, vocab_size=net.get("vocab_size", 128256))


def bf16(strategy: str, mesh: MeshSizes, micro: int, **rest) -> Plan:
    return Plan(strategy, mesh, micro, rest.pop("accumulation", 1), compute_dtype="bfloat16",
                param_dtype="bfloat16", **rest)


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
    lines = [anchors.report(anchors.load(), results["anchors"]), "Predicted weak scaling at 1,024 devices "
             "(efficiency: compute and optimizer time over the step; the rest is exposed communication and the "
             "pipeline bubble):", "",
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
    from litscale.planner import facts_cache

    data = anchors.load()
    facts = {name: anchors.facts_of(spec) for name, spec in data["models"].items()}
    recorded = {name: {"identity": anchors.network_of(spec)[1], "facts": facts_cache.as_plain(facts[name])}
                for name, spec in data["models"].items()}
    results = {"anchors": anchors.predict_all(data, facts), "scaling": scaling()}
    text = report(results)
    print(text)
    if args.no_write:
        return
    (HERE / "simulation.json").write_text(json.dumps(results, indent=1) + "\n")
    # One model a line: its facts hold a number per block (126 of them at 405B).
    anchors.FACTS_FILE.write_text("{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(entry)}"
                                                       for name, entry in recorded.items()) + "\n}\n")
    plot(results, HERE / "scaling.png")
    write_section("simulation", "simulate.py", text)


if __name__ == "__main__":
    main()
