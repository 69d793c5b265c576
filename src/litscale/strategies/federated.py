"""Federated averaging: every data-parallel rank is a client with its own data; rounds of
``local_steps`` optimizer steps on the clients sampled for the round, then the server averages
their parameters weighted by each client's samples.

- **FedAvg** (McMahan et al. 2017): the new global model is ``sum_k n_k w_k / sum_k n_k`` over
  the round's clients ``k``, ``n_k`` the samples client ``k`` holds.
- **FedProx** (Li et al. 2020): ``proximal_mu > 0`` adds ``mu / 2 * ||w - w_global||^2`` to
  each client's loss, pulling it towards the round's starting model.
- **FedOpt** (Reddi et al. 2021): ``outer_optimizer=sgd|nesterov|adam`` treats the global model
  minus the average as a pseudo-gradient for a server optimizer: the outer optimizer of
  DiLoCo (``litscale.strategies.local_sgd``), shared.

Client sampling: ``clients_per_round`` clients a round, drawn from ``(seed, round)`` alone, so
every rank draws the same set without a message. The others idle: a rank runs its forward
and backward (Lightning's loop takes the loss) but takes no optimizer step, and joins the
averaging all-reduce with weight 0, so no collective is skipped. Each client keeps its own
optimizer state (momentum) between the rounds it takes part in, as local SGD does.

Out of scope: secure aggregation (masking each client's update so the server sees only the
sum); here the sum is a plain all-reduce. Clients are simulated, one per rank, so a run may
have more clients than cores (see ``simulates_clients``).
"""

# NOTE: no `from __future__ import annotations`: DDP checks local_sgd_hook's annotations.
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils import parameters_to_vector
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.compression import CommHook
from litscale.constraints import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt
from litscale.parallel.contract import Option
from litscale.parallel.layout import MeshSizes
from litscale.strategies.ddp import DDPStrategy
from litscale.strategies.local_sgd_state import LocalSGDState, OuterOptimizer, local_sgd_hook


def sampled_clients(round_index: int, clients: int, per_round: int | None, seed: int) -> list[int]:
    """The clients of a round, in order: ``per_round`` of ``clients`` drawn without
    replacement from a generator seeded by ``(seed, round_index)`` (all when ``per_round`` is
    None or not fewer)."""
    if per_round is None or per_round >= clients:
        return list(range(clients))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + round_index)
    return sorted(torch.randperm(clients, generator=generator)[:per_round].tolist())


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``mu / 2 * ||w - w_global||^2``; its gradient is ``mu * (w - w_global)``."""
    return 0.5 * mu * sum((p - a).square().sum() for p, a in zip(params, anchor, strict=True))


class FederatedState(LocalSGDState):
    """Rounds, the clients of each, their weights (samples held) and the server's model.

    ``rounds``: one record per finished round (``round``, ``clients``, ``weights``), what the
    run prints and ``summary.json`` keeps. ``bytes_sent`` counts a client's upload: its
    parameters in a round it takes part in, nothing otherwise (in this simulation an idle rank
    still joins the all-reduce with zeros, which a real deployment would not send).
    """

    identical_across_ranks = False  # bytes sent differ by client

    def __init__(self, *, local_steps: int, clients_per_round: int | None, proximal_mu: float,
                 outer_optimizer: str, outer_lr: float, outer_momentum: float, seed: int) -> None:
        super().__init__(sync_every=local_steps, warmup_steps=0, outer_optimizer=outer_optimizer,
                         outer_lr=outer_lr, outer_momentum=outer_momentum)
        self.clients_per_round, self.proximal_mu, self.seed = clients_per_round, proximal_mu, seed
        self.client_samples: list[int] = []  # samples each client holds, by rank
        self.rounds: list[dict[str, Any]] = []
        self._anchor: list[torch.Tensor] | None = None  # the round's starting model, no outer optimizer

    def clients(self, round_index: int) -> list[int]:
        return sampled_clients(round_index, len(self.client_samples), self.clients_per_round, self.seed)

    def round_of_next_step(self) -> int:
        return self.optimizer_steps // self.sync_every

    def takes_part(self, rank: int) -> bool:
        """Whether ``rank`` trains in the round of the coming optimizer step."""
        return rank in self.clients(self.round_of_next_step())

    def weights(self, clients: list[int]) -> list[float]:
        total = sum(self.client_samples[k] for k in clients)
        return [self.client_samples[k] / total for k in clients]

    def global_model(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The parameters the round started from (the server's model); after a resume, rebuilt
        from the checkpoint first."""
        if self._restored_outer is not None:
            self._restore_outer(params)
        if self.outer is not None:
            return self.outer.param_groups[0]["params"]
        if self._anchor is None:
            self.start_local_phase(params)
        self._anchor = [a.to(p) for a, p in zip(self._anchor, params, strict=True)]
        return self._anchor

    @override
    def start_local_phase(self, params: list[torch.nn.Parameter]) -> None:
        super().start_local_phase(params)
        if self.outer is None and self._anchor is None:
            self._anchor = [p.detach().clone() for p in params]

    @override
    def synchronise(self, params: list[torch.nn.Parameter]) -> None:
        """The weighted average over the round's clients, in one all-reduce every rank joins."""
        round_index = (self.optimizer_steps - 1) // self.sync_every
        clients = self.clients(round_index)
        weights = self.weights(clients)
        rank = dist.get_rank(self.group)
        weight = weights[clients.index(rank)] if rank in clients else 0.0
        flat = parameters_to_vector(params) * weight
        dist.all_reduce(flat, group=self.group)
        for param, average in zip(params, flat.split([p.numel() for p in params]), strict=True):
            param.copy_(average.view_as(param))
        if self.outer is not None:
            self._outer_step(params)
        else:
            for anchor, param in zip(self._anchor, params, strict=True):
                anchor.copy_(param)
        if rank in clients:
            self.bytes_sent += sum(p.numel() * p.element_size() for p in params)
        self.rounds.append({"round": round_index, "clients": clients,
                            "weights": [round(w, 6) for w in weights]})
        shares = ", ".join(f"{k}: {w:.2f}" for k, w in zip(clients, weights, strict=True))
        rank_zero_info(f"litscale: round {round_index + 1} (steps {round_index * self.sync_every + 1}-"
                       f"{self.optimizer_steps}): clients {shares} of {len(self.client_samples)}")

    def state_dict(self) -> dict[str, Any]:
        anchor = None if self._anchor is None else [a.detach().cpu() for a in self._anchor]
        return {**super().state_dict(), "anchor": anchor, "rounds": self.rounds,
                "client_samples": self.client_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds, self.client_samples = list(state["rounds"]), list(state["client_samples"])
        self._anchor = state["anchor"]


def client_samples(trainer: Any) -> int:
    """The samples this rank's client holds: its sampler's ``client_samples`` (a non-IID
    partition, ``litscale.data.partition``) or, for an even split, the sampler's length."""
    sampler = getattr(trainer.train_dataloader, "sampler", None)
    return int(getattr(sampler, "client_samples", None) or len(sampler))


class FederatedStrategy(DDPStrategy):
    """Federated averaging over clients, one per data-parallel rank: FedAvg weighted by each
    client's samples, FedProx (``proximal_mu``), FedOpt (``outer_optimizer``) and client
    sampling (``clients_per_round``). See the module's docstring."""

    averages_across_replica_groups = False  # each rank steps on its own gradients
    refuses = {Option.LAYOUT_INVARIANT: "each client's optimizer steps on its own data before the models are "
               "averaged, so the model depends on the number of clients by design",
               Option.COMPRESSION: "its rounds' averaging already is its communication hook"}
    untraced = "its rounds' averaging is not traced"
    phase_collectives = {"optimizer": "parameter all-reduce (end of a round)"}
    simulates_clients = True  # more clients than cores is a simulation's normal case
    ranks_step_together = False  # a round's unpicked clients train no step: each logs its own loss
    plannable = False  # rounds of local steps, then averaging: not the planner's synchronous step

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        local_steps: PositiveInt = 10,
        clients_per_round: PositiveInt | None = None,
        proximal_mu: NonNegativeFloat = 0.0,
        outer_optimizer: OuterOptimizer = "none",
        outer_lr: PositiveFloat = 1.0,
        outer_momentum: Fraction = 0.9,
        seed: int = 0,
        bucket_cap_mb: PositiveFloat = 25,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        self.federated = FederatedState(local_steps=local_steps, clients_per_round=clients_per_round,
                                        proximal_mu=proximal_mu, outer_optimizer=outer_optimizer,
                                        outer_lr=outer_lr, outer_momentum=outer_momentum, seed=seed)
        super().__init__(compression=CommHook(hook=local_sgd_hook, state=self.federated),
                         bucket_cap_mb=bucket_cap_mb, process_group_backend=process_group_backend,
                         timeout_s=timeout_s)

    @property
    def result(self) -> dict[str, Any]:
        """What ``summary.json`` keeps: the clients' samples and every round's clients and weights."""
        state = self.federated
        return {"federated/client_samples": state.client_samples, "federated/rounds": state.rounds}

    @override
    def resolve_mesh(self, world_size: int) -> MeshSizes:
        per_round = self.federated.clients_per_round
        if per_round is not None and per_round > world_size:
            raise ValueError(
                f"strategy.clients_per_round={per_round} is more than the {world_size} clients "
                f"(one per rank: trainer.devices x trainer.num_nodes); allowed: 1..{world_size}")
        return super().resolve_mesh(world_size)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        state = self.federated
        samples = [0] * self.world_size
        dist.all_gather_object(samples, client_samples(self.lightning_module.trainer))
        state.client_samples = samples
        if state.optimizer_steps == 0:
            state.start_local_phase(self._params())
        rank_zero_info(f"litscale: federated: {self.world_size} clients holding {samples} samples, "
                       f"{state.clients_per_round or self.world_size} a round of {state.sync_every} "
                       f"local steps")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        mu = self.federated.proximal_mu
        if not mu:
            return output
        params = self._params()
        term = proximal_term(params, self.federated.global_model(params), mu)
        if isinstance(output, dict):
            return {**output, "loss": output["loss"] + term}
        return output + term

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        state = self.federated
        if state.takes_part(self.global_rank):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            output = closure()  # Lightning's loop takes the loss; an idle client takes no step
        state.after_optimizer_step(self._params())
        return output
