"""Streaming DiLoCo (``strategy=local_sgd strategy.fragments=F``): the fragments and their
schedule; the quantized outer gradient and its error feedback against their formulas; on 2
gloo ranks, F=1 against local SGD re-derived (DiLoCo) and F=2 (with and without overlap)
against streaming DiLoCo re-derived here from the paper's algorithm; one quantized run through
``train.py``; config errors."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from helpers.cli import explain, summaries
from helpers.configs import compose_job
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool
from helpers.parity import (
    TINY_WITH_BIASES,
    ParitySetup,
    Trace,
    assert_traces_match,
    fit,
    full_gradients,
    local_sgd_reference,
    module_for,
    rank_loader,
    tiny_module,
    tiny_net,
)

from litscale.app.checks.validation import ConfigError, validate
from litscale.compression.outer_quantization import (
    BLOCK,
    dequantize,
    payload_size,
    quantize,
    quantize_with_feedback,
)
from litscale.strategies.streaming import InFlight, StreamingState, parameter_fragments

# --- the quantized outer gradient against its formulas -------------------------------------


def _vector(numel: int = 3 * BLOCK + 17, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.logspace(
        -3, 0, numel
    )  # mixed magnitudes


def _by_block(flat: torch.Tensor, numel: int):
    for start in range(0, numel, BLOCK):
        yield slice(start, min(start + BLOCK, numel))


def test_int4_is_symmetric_absmax_rounding_per_block():
    flat = _vector()
    quantized = quantize(flat, "int4")
    decoded = dequantize(quantized, "int4")
    for block in _by_block(flat, flat.numel()):
        scale = flat[block].abs().max() / 7
        expected = torch.clamp(torch.round(flat[block] / scale), -7, 7) * scale
        torch.testing.assert_close(decoded[block], expected, rtol=0, atol=1e-7)
    blocks = -(-flat.numel() // BLOCK)
    assert (
        quantized.nbytes == blocks * BLOCK // 2 + 4 * blocks
    )  # two codes a byte, an fp32 scale a block
    assert (quantized.payload.numel(), quantized.scales.numel()) == payload_size(
        flat.numel(), "int4"
    )


def _e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3 (fn) value from its definition: 4 exponent bits (bias 7), 3
    mantissa bits, subnormals at exponent 0, S.1111.111 the only NaN (so 448 the largest)."""
    magnitudes = [
        (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        for e, m in itertools.product(range(16), range(8))
        if (e, m) != (15, 7)
    ]
    return torch.tensor(
        sorted({sign * v for v in magnitudes for sign in (1, -1)}), dtype=torch.float64
    )


def test_fp8_e4m3_is_the_nearest_e4m3_value_of_the_scaled_block():
    flat, values = _vector(seed=1), _e4m3_values()
    assert values.max() == 448
    decoded = dequantize(quantize(flat, "fp8_e4m3"), "fp8_e4m3")
    for block in _by_block(flat, flat.numel()):
        scale = flat[block].abs().max() / 448
        scaled = (flat[block] / scale).double()
        nearest = values[(scaled[:, None] - values[None, :]).abs().argmin(dim=1)]
        torch.testing.assert_close(decoded[block], (nearest * scale).float(), rtol=1e-6, atol=0)
    assert quantize(flat, "fp8_e4m3").nbytes == 4 * BLOCK + 4 * 4


def test_bf16_is_a_cast():
    flat = _vector(seed=2)
    assert torch.equal(dequantize(quantize(flat, "bf16"), "bf16"), flat.to(torch.bfloat16).float())
    assert quantize(flat, "bf16").nbytes == 2 * flat.numel()


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "int4"])
def test_error_feedback_sends_what_quantizing_lost_later(dtype):
    """Each residual is the input plus the last residual minus what was sent, so after k
    rounds what was sent plus the residual left is exactly what was to be sent."""
    residual, sent, inputs = None, torch.zeros(300), torch.zeros(300)
    for round_index in range(5):
        outer_gradient = _vector(300, seed=10 + round_index)
        target = outer_gradient if residual is None else outer_gradient + residual
        quantized, new_residual = quantize_with_feedback(outer_gradient, residual, dtype)
        torch.testing.assert_close(
            dequantize(quantized, dtype), dequantize(quantize(target, dtype), dtype)
        )
        torch.testing.assert_close(new_residual, target - dequantize(quantized, dtype))
        residual, inputs = new_residual, inputs + outer_gradient
        sent += dequantize(quantized, dtype)
    torch.testing.assert_close(sent + residual, inputs, rtol=0, atol=1e-5)


# --- fragments and their schedule ------------------------------------------------------------


@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
def test_fragments_hold_every_parameter_once_by_strided_blocks(fragments):
    module = tiny_module(ParitySetup(config=TINY_WITH_BIASES))  # units: embeddings, 2 blocks, head
    names = parameter_fragments(module, fragments)
    assert sorted(itertools.chain(*names)) == sorted(n for n, _ in module.named_parameters())
    units = [
        ("net.wte.", "net.wpe."),
        ("net.blocks.0.",),
        ("net.blocks.1.",),
        ("net.ln_f.", "net.lm_head."),
    ]
    for unit, prefixes in enumerate(units):
        members = [n for n, _ in module.named_parameters() if n.startswith(prefixes)]
        assert members and set(members) <= set(names[unit % fragments])


@pytest.mark.parametrize(("sync_every", "fragments"), [(4, 1), (4, 2), (8, 3), (6, 6)])
def test_each_fragment_syncs_once_a_period_one_at_a_time(sync_every, fragments):
    state = StreamingState(
        sync_every=sync_every,
        warmup_steps=0,
        outer_optimizer="nesterov",
        outer_lr=0.7,
        outer_momentum=0.9,
        fragments=fragments,
        outer_dtype="fp32",
        overlap_steps=0,
        mixing_factor=0.0,
    )
    due = {step: state.due_fragments(step) for step in range(1, 4 * sync_every + 1)}
    assert all(len(fragments_due) <= 1 for fragments_due in due.values())
    for start in range(1, 3 * sync_every + 2):  # every window of a period, wherever it starts
        window = [f for step in range(start, start + sync_every) for f in due[step]]
        assert sorted(window) == list(range(fragments))
    assert due[sync_every] == [0]  # fragment 0 at the end of each period, as DiLoCo syncs


def test_a_checkpoint_keeps_exchanges_in_flight_and_residuals():
    """Saved between a fragment's exchange and its merge, then resumed: the merge lands as it
    would have, and each rank's error-feedback residuals come back."""
    options = {
        "sync_every": 4,
        "warmup_steps": 0,
        "outer_optimizer": "nesterov",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "fragments": 2,
        "outer_dtype": "int4",
        "overlap_steps": 1,
        "mixing_factor": 0.5,
    }
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    state = StreamingState(**options)
    state.set_fragments([["a"], ["b"]], ["a", "b"])
    state.start_local_phase(params)
    state.residuals_by_fragment[1] = torch.randn(4)
    state.in_flight.append(InFlight(1, due=3, quantized=True, result=torch.randn(4)))
    state.syncs, state.sync_bytes, state.peak_bytes = 1, 100, 100
    restored = StreamingState(**options)
    saved = io.BytesIO()  # as a checkpoint file holds it: no tensor shared with the running state
    torch.save(state.state_dict(), saved)
    saved.seek(0)
    restored.load_state_dict(torch.load(saved, weights_only=False))
    restored.set_fragments([["a"], ["b"]], ["a", "b"])
    restored._restore_outer(resumed_params)
    assert not restored.identical_across_ranks  # int4 residuals: every rank's is kept
    assert torch.equal(restored.residuals_by_fragment[1], state.residuals_by_fragment[1])
    assert (restored.syncs, restored.sync_bytes, restored.peak_bytes) == (1, 100, 100)
    before = [p.detach().clone() for p in params]
    state.finish(params)
    restored.finish(resumed_params)
    for expected, actual in zip(params, resumed_params, strict=True):
        assert torch.equal(actual, expected)
    # only the fragment in flight (1) was merged
    assert torch.equal(params[0], before[0]) and not torch.equal(params[1], before[1])


# --- on 2 ranks, against the algorithm re-derived -------------------------------------------


SETUPS = {
    name: ParitySetup(config=TINY_WITH_BIASES, optimizer=name, weight_decay=0.1, steps=8)
    for name in ("sgd", "adamw")
}
OUTER = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
CASES = {  # name: (strategy options, setups)
    "f1": ({"sync_every": 4, "fragments": 1}, ("sgd", "adamw")),
    "f2": ({"sync_every": 4, "fragments": 2}, ("sgd", "adamw")),
    "f3_overlap": (
        {"sync_every": 6, "fragments": 3, "overlap_steps": 1, "mixing_factor": 0.5},
        ("sgd",),
    ),
}


def streaming_reference(
    setup: ParitySetup,
    world_size: int,
    *,
    sync_every: int,
    fragments: int,
    overlap_steps: int = 0,
    mixing_factor: float = 0.0,
) -> list[Trace]:
    """Streaming DiLoCo in one process (Douillard et al. 2025, Algorithm 1): ``world_size``
    replicas step on their rows; fragment ``p`` (the GPT's units dealt strided: embeddings,
    each block, final norm + head) is due after local step ``t`` when ``t = p * H / P (mod H)``;
    then its outer gradient ``mean_m(theta_global_p - theta_m_p)`` feeds its own outer Nesterov
    SGD over ``theta_global_p``, and ``tau`` steps later each replica takes
    ``alpha * theta_m_p + (1 - alpha) * theta_global_p``."""
    nets = [tiny_net(setup) for _ in range(world_size)]
    modules = [module_for(net, setup) for net in nets]
    optimizers = [module.configure_optimizers() for module in modules]
    batches = [list(rank_loader(setup, world_size, rank)) for rank in range(world_size)]
    units = ["wte wpe", *(f"blocks.{i}" for i in range(setup.config.n_layer)), "ln_f lm_head"]
    fragment_of = {
        name: next(
            u
            for u, unit in enumerate(units)
            if name.split(".")[0] in unit.split() or name.startswith(unit + ".")
        )
        % fragments
        for name, _ in nets[0].named_parameters()
    }
    global_params = {name: p.detach().clone() for name, p in nets[0].named_parameters()}
    outer = [
        torch.optim.SGD(
            [global_params[n] for n, f in fragment_of.items() if f == p],
            lr=0.7,
            momentum=0.9,
            nesterov=True,
        )
        for p in range(fragments)
    ]
    losses, gradients, in_flight = [], [[] for _ in nets], []
    for step in range(setup.steps):
        step_losses = []
        for rank, (net, module, optimizer) in enumerate(
            zip(nets, modules, optimizers, strict=True)
        ):
            optimizer.zero_grad()
            loss = module.loss(batches[rank][step])
            loss.backward()
            step_losses.append(loss.item())
            gradients[rank].append(full_gradients(net))
            optimizer.step()
        losses.append(sum(step_losses) / world_size)
        t = step + 1
        with torch.no_grad():
            for p in range(fragments):
                if (t - p * sync_every // fragments) % sync_every == 0:
                    outer_gradient = {
                        n: torch.stack(
                            [global_params[n] - dict(net.named_parameters())[n] for net in nets]
                        ).mean(0)
                        for n, f in fragment_of.items()
                        if f == p
                    }
                    in_flight.append((t + overlap_steps, p, outer_gradient))
            # an exchange still in flight when training ends lands then (its bytes were sent)
            landing = [e for e in in_flight if e[0] == t or step == setup.steps - 1]
            for _, p, outer_gradient in landing:
                for name, value in outer_gradient.items():
                    global_params[name].grad = value
                outer[p].step()
                for net in nets:
                    for name, param in net.named_parameters():
                        if name in outer_gradient:
                            param.mul_(mixing_factor).add_(
                                global_params[name], alpha=1 - mixing_factor
                            )
            in_flight = [e for e in in_flight if e not in landing]
    return [
        Trace(losses, gradients[rank], {k: v.detach().clone() for k, v in net.state_dict().items()})
        for rank, net in enumerate(nets)
    ]


def _fit_cases(rank: int, world_size: int) -> dict:
    from litscale.strategies import LocalSGDStrategy

    results = {}
    for name, (options, optimizers) in CASES.items():
        for optimizer in optimizers:
            strategy = LocalSGDStrategy(**OUTER, **options)
            trace = fit(
                rank, world_size, strategy, SETUPS[optimizer], gradients=True, local_weights=True
            )
            module_names = [
                n for n, p in strategy.lightning_module.named_parameters() if p.requires_grad
            ]
            results[name, optimizer] = (
                trace,
                strategy.fragment_names,
                module_names,
                strategy.local_sgd.totals(),
            )
    return results


@pytest.fixture(scope="module")
def fits():
    return run_distributed(_fit_cases, 2, timeout=400)


def _expected(name: str, optimizer: str) -> list[Trace]:
    options = CASES[name][0]
    if name == "f1":  # DiLoCo as local SGD's reference re-derives it
        return local_sgd_reference(
            SETUPS[optimizer], 2, options["sync_every"], outer_lr=0.7, outer_momentum=0.9
        )
    return streaming_reference(SETUPS[optimizer], 2, **options)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    ("name", "optimizer"), [(n, o) for n, (_, opts) in CASES.items() for o in opts]
)
def test_streaming_matches_its_single_process_derivation(name, optimizer, fits):
    expected = _expected(name, optimizer)
    for rank, rank_results in enumerate(fits):
        trace, fragment_names, module_names, totals = rank_results[name, optimizer]
        # the strategy's own fragments: every trainable parameter in exactly one
        assert sorted(itertools.chain(*fragment_names)) == sorted(module_names), rank
        assert len(fragment_names) == CASES[name][0]["fragments"]
        assert_traces_match(trace, expected[rank])
        params = {n: p for n, p in tiny_module(SETUPS[optimizer]).named_parameters()}
        sizes = [4 * sum(params[n].numel() for n in fragment) for fragment in fragment_names]
        assert totals["peak_bytes"] == max(sizes)  # fp32: a fragment's parameters, once a sync
        assert totals["syncs"] == sum(
            1
            for t in range(1, 9)
            for f in range(len(sizes))
            if (t - f * CASES[name][0]["sync_every"] // len(sizes)) % CASES[name][0]["sync_every"]
            == 0
        )


# --- through train.py ----------------------------------------------------------------------

RUN = (
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "trainer.max_steps=8",
    "trainer.val_check_interval=8",
    "trainer.limit_val_batches=2",
    "trainer.accelerator=cpu",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.enable_progress_bar=false",
    "trainer.gradient_clip_val=null",
    "trainer.log_every_n_steps=4",
)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_int4_streaming_run_sends_one_quantized_fragment_at_a_time(tmp_path):
    """GPT nano (6 blocks) in 3 fragments, int4: each sync sends one fragment's int4 codes and
    block scales; 8 steps of period 4 sync the 3 fragments 6 times."""
    run = train_on_pool(
        *RUN,
        "data.batch_size=4",
        "strategy=local_sgd",
        "strategy.sync_every=4",
        "strategy.outer_optimizer=nesterov",
        "strategy.fragments=3",
        "strategy.outer_dtype=int4",
        "trainer.devices=2",
        "name=streaming",
        outputs=tmp_path,
        devices=2,
    )
    assert run.returncode == 0, explain(run)
    (summary,) = summaries(tmp_path)
    assert summary["val/loss"] < summary["val/loss_initial"]
    sizes = summary["local_sgd/fragment_params"]
    assert len(sizes) == 3 and sum(sizes) == summary["num_params"]
    wire = [payload_size(size, "int4")[0] + 4 * payload_size(size, "int4")[1] for size in sizes]
    assert summary["comm/syncs"] == 6
    assert summary["comm/peak_bytes"] == max(wire)
    assert summary["comm/bytes_per_sync"] == pytest.approx(sum(wire) * 2 / 6)
    # int4 alone is an eighth of DiLoCo's whole fp32 model; one fragment of three is less still
    assert summary["comm/peak_bytes"] < 4 * summary["num_params"] / 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.fragments=0"], "strategy.fragments=0 is not valid: expected an int >= 1"),
        (
            ["strategy.fragments=7"],
            "strategy.fragments=7 is more than the 6 blocks GPT declares (pipeline_blocks); allowed: 1..6",
        ),
        (
            ["strategy.outer_dtype=fp16"],
            "strategy.outer_dtype='fp16' is not valid: expected one of: 'fp32', 'bf16', 'fp8_e4m3', 'int4'",
        ),
        (
            ["strategy.sync_every=4", "strategy.fragments=5"],
            "strategy.fragments=5 is more than strategy.sync_every=4",
        ),
        (
            ["strategy.sync_every=4", "strategy.overlap_steps=4"],
            "strategy.overlap_steps=4 is not fewer than strategy.sync_every=4",
        ),
    ],
)
def test_bad_streaming_values_are_one_line_errors(overrides, message, tmp_path, outputs_root):
    cfg, choices = compose_job(
        ["strategy=local_sgd", "trainer.devices=2", *overrides], tmp_path / "run"
    )
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
