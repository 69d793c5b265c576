"""Federated averaging: a sampled round against a one-process re-derivation of the weighted
average, client sampling, FedProx's gradient against its formula, non-IID partitions and their
label statistics, the issue's command end to end, config errors. (FedAvg == DDP's SGD, FedProx
and FedOpt through Lightning: the ``federated`` family of ``test_parity.py``.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.cli import explain, run_train, summaries
from helpers.configs import compose_job
from helpers.distributed import run_distributed

from litscale.app.checks.validation import ConfigError, validate
from litscale.data.partition import (
    ClientSampler,
    label_histograms,
    label_skew,
    partition_indices,
)
from litscale.strategies.federated import FederatedState, proximal_term, sampled_clients

LOCAL_STEPS, ROUNDS = 2, 6


def _samples(clients: int) -> list[int]:
    return [10 * (k + 1) for k in range(clients)]  # unequal: the weights are not a plain mean


def _initial() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=generator), torch.randn(4, generator=generator)]


def _update(client: int, step: int) -> list[torch.Tensor]:
    """What client ``client``'s optimizer step ``step`` subtracts: a function of both alone."""
    generator = torch.Generator().manual_seed(1000 * client + step)
    return [0.1 * torch.randn(t.shape, generator=generator) for t in _initial()]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _sampled_rounds(rank: int, world_size: int, per_round: int) -> dict:
    params = [torch.nn.Parameter(t) for t in _initial()]
    state = FederatedState(local_steps=LOCAL_STEPS, clients_per_round=per_round, proximal_mu=0.0,
                           outer_optimizer="none", outer_lr=1.0, outer_momentum=0.9, seed=7)
    state.client_samples = _samples(world_size)
    state.start_local_phase(params)
    trajectory = []
    for step in range(LOCAL_STEPS * ROUNDS):
        if state.takes_part(rank):
            with torch.no_grad():
                for param, update in zip(params, _update(rank, step), strict=True):
                    param -= update
        state.after_optimizer_step(params)
        trajectory.append(_flat(params))
    return {"trajectory": trajectory, "rounds": state.rounds, "bytes": state.bytes_sent}


def _re_derived(clients: int, rounds: list[dict]) -> list[list[torch.Tensor]]:
    """Every client's parameters after every step, in one process: the round's clients step
    from the global model, the others hold it; at the round's end the global model is the
    average of the clients' parameters weighted by the samples they hold."""
    samples, global_model = _samples(clients), _flat(_initial())
    expected: list[list[torch.Tensor]] = [[] for _ in range(clients)]
    for record in rounds:
        chosen, local = record["clients"], {k: global_model.clone() for k in record["clients"]}
        for offset in range(LOCAL_STEPS):
            step = record["round"] * LOCAL_STEPS + offset
            for k in chosen:
                local[k] -= _flat(_update(k, step))
            if offset < LOCAL_STEPS - 1:
                for k in range(clients):
                    expected[k].append(local.get(k, global_model).clone())
        global_model = sum(samples[k] * local[k] for k in chosen) / sum(samples[k] for k in chosen)
        for k in range(clients):
            expected[k].append(global_model)
    return expected


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("clients", "per_round"), [
    (2, 1), pytest.param(4, 2, marks=pytest.mark.full)])
def test_a_sampled_round_is_the_weighted_average_of_its_clients(clients, per_round):
    ranks = run_distributed(_sampled_rounds, clients, per_round, timeout=240)
    rounds = ranks[0]["rounds"]
    assert all(result["rounds"] == rounds for result in ranks)  # drawn alike, with no message
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    assert all(len(r["clients"]) == per_round for r in rounds)
    assert len({tuple(r["clients"]) for r in rounds}) > 1  # not the same clients every round
    for record in rounds:
        held = [_samples(clients)[k] for k in record["clients"]]
        assert record["weights"] == pytest.approx([n / sum(held) for n in held])
    expected = _re_derived(clients, rounds)
    param_bytes = 4 * _flat(_initial()).numel()
    for rank, result in enumerate(ranks):
        for step, (actual, wanted) in enumerate(zip(result["trajectory"], expected[rank], strict=True)):
            torch.testing.assert_close(actual, wanted, rtol=1.3e-6, atol=1e-6, msg=f"rank {rank} step {step}")
        # a client uploads its parameters in the rounds it takes part in, nothing otherwise
        assert result["bytes"] == param_bytes * sum(rank in r["clients"] for r in rounds)


def test_client_sampling_is_seeded_and_covers_every_client():
    draws = [sampled_clients(r, 8, 3, seed=1) for r in range(40)]
    assert draws == [sampled_clients(r, 8, 3, seed=1) for r in range(40)]
    assert draws != [sampled_clients(r, 8, 3, seed=2) for r in range(40)]
    assert all(len(d) == 3 == len(set(d)) and d == sorted(d) for d in draws)
    assert set().union(*draws) == set(range(8))
    assert sampled_clients(5, 4, None, seed=0) == sampled_clients(5, 4, 4, seed=0) == [0, 1, 2, 3]


def test_fedprox_gradient_is_mu_times_the_distance_from_the_global_model():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 4, generator=generator, requires_grad=True)
    bias = torch.randn(6, generator=generator, requires_grad=True)
    anchor = [torch.randn(6, 4, generator=generator), torch.randn(6, generator=generator)]
    inputs = torch.randn(5, 4, generator=generator)
    (inputs @ weight.T + bias).square().mean().backward()
    plain = [weight.grad.clone(), bias.grad.clone()]
    weight.grad = bias.grad = None
    mu = 0.3
    loss = (inputs @ weight.T + bias).square().mean() + proximal_term([weight, bias], anchor, mu)
    loss.backward()
    for param, g, start in zip((weight, bias), plain, anchor, strict=True):
        torch.testing.assert_close(param.grad, g + mu * (param.detach() - start))


# --- non-IID partitions -----------------------------------------------------------------------

LABELS = np.random.default_rng(0).integers(0, 10, 2000)


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "shards"])
def test_a_partition_is_seeded_and_gives_every_sample_to_one_client(partition):
    parts = partition_indices(LABELS, 8, partition, alpha=0.3, shards_per_client=2, seed=5, min_samples=16)
    assert parts == partition_indices(LABELS, 8, partition, alpha=0.3, shards_per_client=2, seed=5,
                                      min_samples=16)
    assert parts != partition_indices(LABELS, 8, partition, alpha=0.3, shards_per_client=2, seed=6,
                                      min_samples=16)
    assert sorted(i for part in parts for i in part) == list(range(len(LABELS)))
    assert min(len(part) for part in parts) >= 16


def test_label_skew_falls_as_dirichlet_alpha_grows_and_shards_hold_few_classes():
    def skew(partition, **options):
        parts = partition_indices(LABELS, 8, partition, seed=0, **{"alpha": 1.0, "shards_per_client": 2, **options})
        return label_skew(label_histograms(LABELS, parts, 10)), label_histograms(LABELS, parts, 10)

    skews = [skew("dirichlet", alpha=alpha)[0] for alpha in (0.1, 1.0, 100.0)]
    assert skews[0] > skews[1] > skews[2] and skews[2] < 0.1 < 0.5 < skews[0]
    assert skew("iid")[0] < 0.1
    _, shards = skew("shards")
    # 2 label-sorted shards of 125 samples (of ~200 per class): at most 2 classes each, plus
    # one more where a shard crosses a class boundary
    assert all(sum(count > 0 for count in histogram) <= 4 for histogram in shards)


def test_label_skew_and_histograms_by_hand():
    assert label_histograms([0, 1, 1, 2], [[0, 1], [2, 3]], 3) == [[1, 1, 0], [0, 1, 1]]
    assert label_skew([[10, 0], [0, 10]]) == pytest.approx(0.5)  # each client half off the whole
    assert label_skew([[5, 5], [3, 3]]) == pytest.approx(0.0)
    assert label_skew([[9, 1], [1, 9]]) == pytest.approx(0.4)


def test_client_sampler_draws_its_own_samples_for_an_equal_epoch():
    sampler = ClientSampler([3, 8, 11], epoch_samples=7, seed=0, client=2)
    first = list(sampler)
    assert len(first) == len(sampler) == 7 and sampler.client_samples == 3
    assert set(first) == {3, 8, 11} and sorted(first[:3]) == [3, 8, 11]  # each once before repeats
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and list(sampler) == second  # reshuffled per epoch, reproducibly
    sampler.resume_at(1, 4)
    sampler.set_epoch(3)  # Lightning's epoch after a resume may run ahead of the data's
    assert sampler.epoch == 1 and list(sampler) == second[4:]


def _digits(partition: str, clients: int, rank: int, **options):
    from litscale.data.digits import DigitsDataModule

    data = DigitsDataModule(batch_size=32, partition=partition, seed=0, **options)
    data.setup()
    data.replicas = lambda: (clients, rank)
    return data


def test_digits_dirichlet_clients_hold_disjoint_skewed_shards():
    modules = [_digits("dirichlet", 4, rank, alpha=0.1) for rank in range(4)]
    samplers = [data.train_sampler() for data in modules]
    held = [set(s.indices.tolist()) for s in samplers]
    train = len(modules[0].train_dataset)
    assert sum(len(h) for h in held) == len(set().union(*held)) == train  # disjoint, all of train
    assert len({len(s) for s in samplers}) == 1  # every client's epoch is as long
    facts = _digits("dirichlet", 4, 0, alpha=0.1)
    facts.train_sampler()
    assert facts.partition_facts["client_samples"] == [len(h) for h in held]
    assert facts.partition_facts["label_skew"] > 0.4


def test_a_partition_of_data_without_labels_is_an_error():
    from litscale.data.synthetic import SyntheticDataModule

    data = SyntheticDataModule(batch_size=4, partition="dirichlet", num_samples=64, val_samples=8)
    data.setup()
    with pytest.raises(ValueError, match=r"^data.partition=dirichlet splits samples by label, but "
                                         r"SyntheticDataModule has no labels; use data.partition=iid$"):
        data.train_sampler()


def test_synthetic_images_split_by_label():
    from litscale.data.synthetic import SyntheticDataModule

    data = SyntheticDataModule(batch_size=4, task="classification", partition="shards", num_samples=200,
                               val_samples=8, input_shape=[1, 4, 4], num_classes=4, shards_per_client=1)
    data.setup()
    data.replicas = lambda: (4, 1)
    sampler = data.train_sampler()
    labels = {int(data.train_dataset[i][1]) for i in sampler.indices.tolist()}
    assert len(labels) <= 2  # one label-sorted shard: a class, or two at a boundary


# --- the command line -------------------------------------------------------------------------

ISSUE_COMMAND = ("experiment=digits_mlp", "strategy=federated", "strategy.clients_per_round=2",
                 "data.partition=dirichlet", "data.alpha=0.1", "trainer.accelerator=cpu", "trainer.devices=4")


@pytest.mark.soak  # 4 ranks
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_issue_command_trains_and_prints_participation_and_label_skew(tmp_path):
    """The command as written (4 clients on any number of cores), shortened to 2 rounds."""
    run = run_train(*ISSUE_COMMAND, "trainer.max_steps=20", "trainer.val_check_interval=20",
                    "trainer.enable_progress_bar=false", outputs=tmp_path, timeout=400)
    assert run.returncode == 0, explain(run)
    (summary,) = summaries(tmp_path)
    data, rounds = summary["data"], summary["federated/rounds"]
    assert summary["val/accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert [sum(h) for h in data["label_histograms"]] == data["client_samples"] == summary["federated/client_samples"]
    assert sum(data["client_samples"]) == 1438 and data["label_skew"] > 0.3
    assert [r["round"] for r in rounds] == [0, 1] and all(len(r["clients"]) == 2 for r in rounds)
    printed = run.stdout + run.stderr  # litscale's lines from inside the fit are logged (stderr)
    assert f"label skew {data['label_skew']:.3f}" in printed
    for r in rounds:
        shares = ", ".join(f"{k}: {w:.2f}" for k, w in zip(r["clients"], r["weights"], strict=True))
        assert f"round {r['round'] + 1} (steps" in printed and f"clients {shares} of 4" in printed
    assert json.loads(json.dumps(data))["label_histograms_plot"].endswith("label_histograms.png")


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy=federated", "trainer.devices=2", "strategy.clients_per_round=3"],
     "strategy.clients_per_round=3 is more than the 2 clients (one per rank: trainer.devices x "
     "trainer.num_nodes); allowed: 1..2"),
    (["strategy=federated", "strategy.outer_optimizer=lamb"],
     "strategy.outer_optimizer='lamb' is not valid: expected one of: 'none', 'nesterov', 'sgd', 'adam'"),
    (["strategy=federated", "compression=topk"], "compression=topk is not supported with strategy=federated"),
    (["experiment=digits_mlp", "data.partition=labels"],
     "data.partition='labels' is not valid: expected one of: 'iid', 'dirichlet', 'shards'"),
    (["experiment=digits_mlp", "data.alpha=0"], "data.alpha=0 is not valid: expected a number > 0"),
])
def test_bad_federated_values_are_one_line_errors(overrides, message, tmp_path, outputs_root):
    cfg, choices = compose_job([*overrides, "trainer.accelerator=cpu"], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_federated_clients_may_outnumber_the_cores(tmp_path, outputs_root):
    cfg, choices = compose_job(["strategy=federated", "trainer.accelerator=cpu", "trainer.devices=16"],
                               tmp_path / "run")
    assert validate(cfg, choices=choices).world_size == 16
