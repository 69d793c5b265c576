"""The anchors' table: every published run in ``anchors.json`` predicted by litscale's cost model
at its published layout, precision and batch, beside its published tokens/s per GPU.

``simulate.py`` runs it and writes the table into README.md and ``simulation.json``, and each
model's traced facts with what they depend on into ``anchors_facts.json``;
``tests/test_planner_anchors.py`` predicts the table again from those facts and checks both are
current (a trace of every model would take minutes). Nothing is measured here: the
published figures are each source's (cited in ``anchors.json``), the predictions the cost model's
for a network built on the meta device.

Each row also says what the terms this table needed move: the prediction again without each
(a published run's partial recompute, precision=fp8's casts, the experts' grouped matmuls at their
own measured share of the peak), so a row's error is read against what is modelled.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ANCHORS = HERE / "anchors.json"
FACTS_FILE = HERE / "anchors_facts.json"  # each model's traced facts, as simulate.py last traced them
GOAL = 0.20  # within 20% of the published tokens/s per GPU


def load() -> dict:
    return json.loads(ANCHORS.read_text())


def published_tokens_per_s(anchor: dict) -> float:
    """Tokens/s per GPU as the source gives them, or from its step time and the tokens of a step
    over all its GPUs."""
    published = anchor["published"]
    if "tokens_per_s_per_gpu" in published:
        return float(published["tokens_per_s_per_gpu"])
    return published["tokens_per_step"] / published["step_s"] / anchor["gpus"]


def source_url(source: dict) -> str | None:
    """Where the published figure is, at the commit cited (None: this repository's own file)."""
    if "/" not in source["repo"]:
        return None
    return f"https://github.com/{source['repo']}/blob/{source['commit']}/{source['path']}"


def cluster_of(spec: dict, gpus: int):
    """The cluster file, with the published hardware's own figures where they differ."""
    node = OmegaConf.load(REPO / spec["file"])
    node.nodes = max(1, gpus // node.devices_per_node)
    node = OmegaConf.merge(node, spec.get("overrides", {}))
    return instantiate(node, _convert_="all")


BUILDERS = {"gpt": "litscale.models.gpt.build_gpt", "llama": "litscale.models.llama.build_llama",
            "moe": "litscale.models.moe.build_moe"}


def network_of(spec: dict) -> tuple:
    """The model built on the meta device, and what its facts depend on (``facts_cache.identity``:
    its config, sequence, vocabulary and litscale's code)."""
    from litscale.planner import facts_cache

    module, _, name = BUILDERS[spec["build"]].rpartition(".")
    builder = getattr(__import__(module, fromlist=[name]), name)
    with torch.device("meta"):
        net = builder(**spec["net"])
    key = facts_cache.identity({"_target_": BUILDERS[spec["build"]], **spec["net"]}, seq_len=spec["seq_len"],
                               vocab_size=net.config.vocab_size, compute_dtype="float32", param_dtype="float32")
    return net, key


def facts_of(spec: dict):
    """The model's facts (traced once per model and code, then read from litscale's facts cache:
    a 405B model's trace takes minutes)."""
    from litscale.planner import facts_cache
    from litscale.planner.model_facts import model_facts

    net, key = network_of(spec)
    facts = facts_cache.load(key, net)
    if facts is None:
        facts = model_facts(net, seq_len=spec["seq_len"], vocab_size=net.config.vocab_size)
        facts_cache.store(key, facts)
    return facts


# What names a model's facts, litscale's code left out: a moved module must not make the table
# stale (``tests/test_planner_anchors.py`` traces GPT-2 small again to check the tracer instead).
MODEL_IDENTITY = ("net", "seq_len", "vocab_size", "compute_dtype", "param_dtype")


def recorded_facts(spec: dict, recorded: dict):
    """The facts ``simulation.json`` recorded for this model, carrying its network built again;
    None where the model's config changed since."""
    from litscale.planner import facts_cache

    net, key = network_of(spec)
    if any(json.loads(json.dumps(key[name])) != recorded["identity"][name] for name in MODEL_IDENTITY):
        return None
    return facts_cache.from_plain(recorded["facts"], net)


def recompute_flops_per_token(kind: str | None, facts) -> float:
    """FLOPs per token a published run's partial recompute adds in backward:
    ``selective_op``: torchtitan's selective checkpointing by op (its ``_custom_policy`` at 9dec370
    saves every matmul's output but every second one's in each block, and attention's), so every
    second Linear of a block runs forward again (Llama's k, o and up projections);
    ``layers:<n>``: Megatron's full recompute of ``n`` layers (``recompute_method=block``), their
    whole forward again."""
    if not kind:
        return 0.0
    net = facts.net
    linears = _block_linears(net)
    if kind == "selective_op":
        return sum(2.0 * m.in_features * m.out_features for layer in linears for m in layer[1::2])
    # A layer's forward: its matmuls and attention's (a third of the 12 x heads x head_dim x T
    # the FLOPs per token count for forward and backward).
    config = net.config
    attention = 4.0 * config.n_head * config.head_dim * facts.seq_len
    per_layer = [2.0 * sum(m.in_features * m.out_features for m in layer) + attention for layer in linears]
    return int(kind.split(":")[1]) * sum(per_layer) / len(per_layer)


def selective_saves_bytes_per_token(kind: str | None, facts) -> float:
    """Bytes per token a layer keeps from its forward to its backward under a published run's
    selective checkpointing: ``selective_op`` (torchtitan's by op, as ``recompute_flops_per_token``
    reads it) saves the outputs of every other matmul of a block (Llama's q, v, gate and down
    projections; the others run again in backward), attention's output and its log-sum-exp (fp32,
    one per head), and the checkpoint keeps the layer's input; all in bf16, the mean over the
    layers. 0 for any other kind (Megatron's recompute of whole layers is costed as FLOPs only)."""
    if kind != "selective_op":
        return 0.0
    config = facts.net.config
    attention = config.n_head * config.head_dim * 2 + config.n_head * 4  # output (bf16), log-sum-exp (fp32)
    per_layer = [2 * (sum(m.out_features for m in linears[0::2]) + config.n_embd) + attention
                 for linears in _block_linears(facts.net)]
    return sum(per_layer) / len(per_layer)


def _block_linears(net) -> list[list[torch.nn.Linear]]:
    """Each block's Linear layers in the order its forward calls them (their registration order)."""
    return [[m for m in layer.modules() if isinstance(m, torch.nn.Linear)] for layer in net.layers.values()]


def framework_of(anchor: dict, data: dict, facts):
    """The published run's framework (``anchors.json``: ``frameworks``), with its partial recompute."""
    from litscale.parallel.sharding import Sharding
    from litscale.planner.plan import Framework

    spec = {key: value for key, value in data["frameworks"][anchor["framework"]].items() if key != "source"}
    held = spec.pop("held", None)
    recompute = anchor["predicted_as"].get("recompute")
    return Framework(**spec, held=Sharding(**held) if held else None,
                     recompute_flops_per_token=recompute_flops_per_token(recompute, facts),
                     selective_saves_bytes_per_token=selective_saves_bytes_per_token(recompute, facts))


def plan_of(anchor: dict, data: dict, facts):
    from litscale.parallel.layout import MeshSizes
    from litscale.planner.plan import Plan

    spec = anchor["predicted_as"]
    return Plan(spec["strategy"], MeshSizes(**spec["mesh"]), spec["micro_batch"], spec["accumulation"],
                activation_checkpointing=spec.get("activation_checkpointing", False),
                compute_dtype="bfloat16", param_dtype="bfloat16", microbatches=spec.get("microbatches", 1),
                schedule=spec.get("schedule", "1f1b"), virtual_stages=spec.get("virtual_stages", 1),
                float8=spec.get("float8", False), options=spec.get("options", {}),
                framework=framework_of(anchor, data, facts))


def predict_anchor(anchor: dict, data: dict, facts) -> dict:
    """The prediction and what each of this table's terms moves it by (the prediction without
    the term over the one with it, less 1)."""
    from litscale.planner.cost import predict

    plan = plan_of(anchor, data, facts)
    cluster = cluster_of(data["clusters"][anchor["cluster"]], anchor["gpus"])
    prediction = predict(plan, facts, cluster)
    tokens = prediction.tokens_per_s / anchor["gpus"]
    framework = plan.framework

    def replaced(**changes):
        return dataclasses.replace(plan, framework=dataclasses.replace(framework, **changes))

    without = {
        "recompute": predict(replaced(recompute_flops_per_token=0.0), facts, cluster)
        if framework.recompute_flops_per_token else None,
        "dispatch once per node": predict(replaced(dispatch_once_per_node=False), facts, cluster)
        if framework.dispatch_once_per_node else None,
        "float8 casts": predict(plan, facts, dataclasses.replace(cluster, memory_bandwidth_bytes_s=0.0))
        if plan.float8 else None,
        "grouped matmuls": predict(plan, facts, dataclasses.replace(cluster, grouped_matmul_fractions=[]))
        if facts.moe is not None and cluster.grouped_matmul_fractions else None,
    }
    published = published_tokens_per_s(anchor)
    return {"id": anchor["id"], "published_tps_per_gpu": published, "predicted_tps_per_gpu": tokens,
            "error": tokens / published - 1, "predicted_gib": prediction.peak_bytes / 2**30,
            "fits": prediction.peak_bytes <= cluster.device_memory_bytes,
            "device_gib": cluster.device_memory_bytes / 2**30, "bubble": prediction.bubble,
            "exposed_comm_share": prediction.exposed_comm_s / prediction.step_s,
            "moved_by": {term: tokens / (p.tokens_per_s / anchor["gpus"]) - 1 for term, p in without.items() if p},
            "flops_per_token": facts.flops_per_token}


def predict_all(data: dict, facts: dict) -> list[dict]:
    """Every anchor's row, from its model's ``facts`` (by the model's name in ``anchors.json``)."""
    return [predict_anchor(anchor, data, facts[anchor["model"]]) for anchor in data["anchors"]]


# Ratios between rows of one source: what its own table measures (a schedule's gain, float8's).
COMPARISONS = (
    ("torchtitan 8B FSDP: 128 GPUs / 8 GPUs", "torchtitan-8b-fsdp128", "torchtitan-8b-fsdp8"),
    ("torchtitan 405B: interleaved 1F1B / 1F1B (8 micro-batches each)", "torchtitan-405b-interleaved",
     "torchtitan-405b-1f1b"),
    ("torchtitan 8B on 8 GPUs: float8 / bf16, both compiled", "torchtitan-8b-fsdp8-compile-float8",
     "torchtitan-8b-fsdp8-compile"),
    ("litscale GPT-2 small on one H100: float8 / bf16, both compiled", "litscale-gpt2-small-fp8",
     "litscale-gpt2-small-bf16"),
)


def cause_line(anchor: dict, row: dict, peak_bf16: float) -> str:
    """A row's cause (``anchors.json``), its figures filled in from the source's own and from the
    cost model's FLOPs per token (none typed in)."""
    published = anchor["published"]
    tflops = published.get("model_tflops_per_gpu")
    figures = {}
    if tflops is not None:
        gflops = tflops * 1e3 / row["published_tps_per_gpu"]
        figures = {"tflops": f"{tflops:,}", "share": f"{tflops * 1e12 / peak_bf16:.0%}",
                   "published_gflops": f"{gflops:.0f}", "litscale_gflops": f"{row['flops_per_token'] / 1e9:.0f}",
                   "flops_ratio": f"{row['flops_per_token'] / 1e9 / gflops - 1:.0%}"}
    return anchor["cause"]["text"].format(**figures)


def report(data: dict, rows: list[dict]) -> str:
    anchors = {anchor["id"]: anchor for anchor in data["anchors"]}
    within = sum(abs(r["error"]) <= GOAL for r in rows)
    causes = [r["id"] for r in rows if abs(r["error"]) > GOAL]
    lines = [f"{within} of {len(rows)} rows within {GOAL:.0%} of the published tokens/s per GPU; each other row's "
             "cause is named below it, with what measures it. Layouts, frameworks and the hardware's figures: "
             "`anchors.json`. *moved by*: what each term this table needed changes the prediction by (the "
             "prediction over the one without it).", "",
             "| run | source | published layout | precision | published tok/s/GPU | predicted | error | "
             "within 20% | moved by | not modelled | GiB/GPU predicted (published) |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for r in rows:
        anchor = anchors[r["id"]]
        source, published = anchor["source"], anchor["published"]
        url = source_url(source)
        where = f"[{source['repo']} {source['path']}]({url})" if url else f"{source['repo']} {source['path']}"
        moved = ", ".join(f"{term} {value:+.0%}" for term, value in r["moved_by"].items()) or "-"
        if r["bubble"]:
            moved += f"; bubble {r['bubble']:.0%}"
        memory = f"{r['predicted_gib']:.1f}" + ("" if r["fits"] else f" (**does not fit {r['device_gib']:.0f}**)")
        if "memory_gib" in published:
            memory += f" ({published['memory_gib']})"
        verdict = "yes" if abs(r["error"]) <= GOAL else f"**no**: cause {causes.index(r['id']) + 1}"
        lines.append(
            f"| `{r['id']}` | {where}: {source['where']} | {published['layout']} | {published['precision']} | "
            f"{r['published_tps_per_gpu']:,.0f} | {r['predicted_tps_per_gpu']:,.0f} | {r['error']:+.0%} | {verdict} | "
            f"{moved} | {', '.join(anchor.get('not_modelled', [])) or '-'} | {memory} |")
    peak = cluster_of(data["clusters"]["h100_8x"], 8).peak_flops["bfloat16"]
    by_id = {r["id"]: r for r in rows}
    lines += ["", "Causes of the rows outside 20%:", ""]
    lines += [f"{n}. `{name}`: {cause_line(anchors[name], by_id[name], peak)}." for n, name in enumerate(causes, 1)]
    lines += ["", "| comparison | published | predicted |", "| --- | ---: | ---: |"]
    for label, a, b in COMPARISONS:
        lines.append(f"| {label} | {by_id[a]['published_tps_per_gpu'] / by_id[b]['published_tps_per_gpu']:.3f} | "
                     f"{by_id[a]['predicted_tps_per_gpu'] / by_id[b]['predicted_tps_per_gpu']:.3f} |")
    return "\n".join(lines) + "\n"
