"""Gradient compression against its math, in this process: codecs (unbiasedness, top-k,
signs), error feedback, residuals across a DDP bucket rebuild, bytes counted against the
tensors handed to collectives (a 1-rank DDP model), checkpointed state, config errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import distributed
from helpers.configs import compose_job

from litscale.app.checks.validation import ConfigError, validate
from litscale.compression import CommHook, bf16, fp16, powersgd, qsgd, signsgd, terngrad, topk
from litscale.compression.allgather import _from_bytes, _to_bytes, encode_with_error_feedback
from litscale.compression.codecs import QSGD, ScaledSign, TernGrad, TopK, pack_bits, unpack_bits
from litscale.compression.state import BucketTensors


class FakeBucket:
    """What the hooks read from a ``dist.GradBucket``, for tests without DDP."""

    def __init__(self, gradients: list[torch.Tensor], index: int = 0) -> None:
        self.params = [torch.nn.Parameter(torch.zeros_like(g)) for g in gradients]
        self.flat = torch.cat([g.reshape(-1) for g in gradients])
        self._index = index

    def buffer(self):
        return self.flat

    def index(self):
        return self._index

    def parameters(self):
        return self.params

    def is_last(self):
        return self._index == 0


def round_trip(codec, gradient: torch.Tensor, segments=None, generator=None) -> torch.Tensor:
    segments = segments or (gradient.numel(),)
    uniform = torch.rand(gradient.numel(), generator=generator) if codec.stochastic else None
    return codec.decode(codec.encode(gradient, segments, uniform), segments)


def mean_of_decodings(codec, gradient: torch.Tensor, samples: int, segments=None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros_like(gradient)
    for _ in range(samples):
        total += round_trip(codec, gradient, segments, generator)
    return total / samples


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_bits_round_trip(bits):
    codes = torch.randint(0, 2**bits, (1001,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 1001), codes)


@pytest.mark.slow
def test_qsgd_is_unbiased_and_rounds_to_neighbouring_levels():
    torch.manual_seed(0)
    gradient, codec, samples = torch.randn(1000), QSGD(levels=4, block_size=250), 3000
    norms = gradient.view(4, 250).norm(dim=1).repeat_interleave(250)
    one = round_trip(codec, gradient)
    assert (one - gradient).abs().le(norms / 4 + 1e-6).all()  # one level step at most
    assert torch.allclose((one * 4 / norms).round(), one * 4 / norms, atol=1e-4)  # on a level
    # Each element's rounding error is at most norm / levels, so its standard deviation at
    # most half that; the mean of `samples` decodings is within 5 sigma / sqrt(samples).
    tolerance = 5 * (norms / 4 / 2) / samples**0.5
    assert (mean_of_decodings(codec, gradient, samples) - gradient).abs().le(tolerance).all()


@pytest.mark.slow
def test_terngrad_is_unbiased_and_ternary():
    torch.manual_seed(0)
    gradient, codec, samples = torch.randn(1000), TernGrad(block_size=200), 3000
    scales = gradient.view(5, 200).abs().amax(dim=1).repeat_interleave(200)
    one = round_trip(codec, gradient)
    ratio = one / scales
    assert set(ratio.round().unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.allclose(ratio, ratio.round(), atol=1e-6)
    assert (torch.sign(one) * torch.sign(gradient)).ge(0).all()  # never the opposite sign
    tolerance = 5 * (scales / 2) / samples**0.5
    assert (mean_of_decodings(codec, gradient, samples) - gradient).abs().le(tolerance).all()


def test_topk_keeps_exactly_the_k_largest_magnitudes_of_each_parameter():
    torch.manual_seed(0)
    gradient, segments = torch.randn(10_150), (10_000, 150)
    codec = TopK(ratio=0.01)
    decoded = round_trip(codec, gradient, segments)
    assert (codec.k(10_000), codec.k(150)) == (100, 2)
    assert torch.count_nonzero(decoded) == 102
    for piece, sent, k in ((gradient[:10_000], decoded[:10_000], 100), (gradient[10_000:], decoded[10_000:], 2)):
        largest = piece.abs().topk(k).indices
        assert torch.equal(sent[largest], piece[largest])
        assert torch.count_nonzero(sent) == k


def test_a_bf16_top_k_payload_reads_back_behind_an_odd_number_of_values():
    """bf16 values then int32 indices, as the all-gather carries them: an odd k leaves the
    indices off their 4-byte alignment in the payload (a 4-rank bf16 run crashed there)."""
    torch.manual_seed(0)
    gradient, segments = torch.randn(500, dtype=torch.bfloat16), (300, 200)
    codec = TopK(ratio=0.01)
    parts = codec.encode(gradient, segments)
    assert parts[0].numel() % 2 == 1
    read = _from_bytes(_to_bytes(parts), parts)
    assert all(torch.equal(got, sent) for got, sent in zip(read, parts, strict=True))
    assert torch.equal(codec.decode(read, segments), codec.decode(parts, segments))


def test_scaled_sign_keeps_signs_with_mean_magnitude_per_block():
    torch.manual_seed(0)
    gradient = torch.randn(1100)  # a parameter of 2 full blocks and a partial one, and one of 50
    decoded = round_trip(ScaledSign(block_size=500), gradient, (1050, 50))
    assert torch.equal(torch.sign(decoded), torch.sign(gradient))
    for block in (slice(0, 500), slice(500, 1000), slice(1000, 1050), slice(1050, 1100)):
        expected = gradient[block].abs().mean()
        torch.testing.assert_close(decoded[block].abs(), expected.expand(len(gradient[block])))


@pytest.mark.parametrize("factory", [topk, qsgd, terngrad, signsgd])
def test_error_feedback_loses_nothing_over_two_steps(factory):
    """What was sent over two steps plus the residual left equals the gradients' sum."""
    torch.manual_seed(0)
    state = factory(error_feedback=True).state
    steps = [torch.randn(300), torch.randn(300)]
    sent = torch.zeros(300)
    for gradient in steps:
        bucket = FakeBucket([gradient[:100].view(10, 10), gradient[100:]])
        parts = encode_with_error_feedback(state, bucket)
        sent += state.codec.decode(parts, (100, 200))
    residual = state.residuals.get(0, state.layout(bucket), torch.device("cpu"))
    torch.testing.assert_close(sent + residual, steps[0] + steps[1])
    assert residual.abs().sum() > 0  # the methods are lossy: something was held back


def test_residuals_follow_parameters_across_a_bucket_rebuild():
    store = BucketTensors()
    store.set(0, (("a", "b"), (2, 3)), torch.tensor([1.0, 2, 3, 4, 5]))
    store.set(1, (("c",), (1,)), torch.tensor([6.0]))
    # DDP rebuilt its buckets: c and a now share bucket 0, b is alone in bucket 1.
    assert torch.equal(store.get(0, (("c", "a"), (1, 2)), torch.device("cpu")), torch.tensor([6.0, 1, 2]))
    assert torch.equal(store.get(1, (("b",), (3,)), torch.device("cpu")), torch.tensor([3.0, 4, 5]))
    assert store.get(2, (("d",), (2,)), torch.device("cpu")) is None  # nothing saved for d
    saved = store.per_parameter()
    assert sorted(saved) == ["a", "b", "c"] and torch.equal(saved["b"], torch.tensor([3.0, 4, 5]))


# --- hooks on a real (1-rank) DDP model ---------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group, destroyed however the test ends, once gloo's threads are done with
    the hooks' callbacks (``destroy_process_groups`` says why: destroyed at once, it aborted a
    later test now and then)."""
    with distributed.one_rank_group():
        yield


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))


def _record_collectives(monkeypatch) -> list[int]:
    """Payload bytes of every all_reduce / all_gather from now on (torch's hooks included)."""
    sizes: list[int] = []
    for name, position in (("all_reduce", 0), ("all_gather", 1)):
        original = getattr(dist, name)

        def recording(*args, _original=original, _position=position, **kwargs):
            tensor = args[_position]
            sizes.append(tensor.numel() * tensor.element_size())
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, recording)
    return sizes


def _ddp(hook: CommHook, net: torch.nn.Module | None = None):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(net or _net(), bucket_cap_mb=0.01)  # several buckets
    hook.register(model)
    return model


def _steps(model, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """``steps`` SGD steps on fixed random batches; the synchronised gradients of each."""
    batches = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = []
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=batches)).square().mean().backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return gradients


FACTORIES = {
    "fp16": fp16,
    "bf16": bf16,
    "topk": lambda: topk(ratio=0.05),
    "qsgd": lambda: qsgd(levels=7, block_size=128),
    "terngrad": lambda: terngrad(block_size=128),
    "signsgd": lambda: signsgd(block_size=128),
    "powersgd": lambda: powersgd(rank=2, start_iteration=2),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_bytes_counted_are_the_bytes_handed_to_collectives(name, one_rank_group, monkeypatch):
    hook = FACTORIES[name]()
    sizes = _record_collectives(monkeypatch)
    model = _ddp(hook)
    _steps(model, 4)
    state = hook.state
    assert state.steps == 4
    assert state.bytes_sent == sum(sizes) > 0
    dense = sum(p.numel() * 4 for p in model.parameters())
    assert state.dense_bytes == 4 * dense
    assert state.bytes_sent < state.dense_bytes
    assert model._get_ddp_logging_data()["comm_hook"] == hook.hook.__qualname__


def test_hook_on_one_rank_applies_the_codec_to_the_gradient(one_rank_group):
    """With one rank, the averaged gradient is this rank's decoded gradient, and error
    feedback holds back exactly the difference."""
    hook = topk(ratio=0.1, error_feedback=True)
    model = _ddp(hook)
    (compressed,) = _steps(model, 1)
    (dense,) = _steps(_net(), 1)
    residuals = hook.state.residuals.per_parameter()
    for (name, param), sent, full in zip(model.module.named_parameters(), compressed, dense, strict=True):
        kept = sent != 0
        assert torch.equal(sent[kept], full[kept]), name
        torch.testing.assert_close(sent + residuals[name].view_as(param), full)


@pytest.mark.parametrize("name", ["qsgd", "topk", "powersgd"])
def test_state_dict_round_trip_continues_identically(name, one_rank_group):
    """Steps after loading a saved state (into a fresh hook on a fresh DDP model with the
    saved weights) repeat the steps the saving run took: residuals, PowerSGD's iteration,
    P/Q matrices and RNG, and the rounding RNG all carried."""
    factory = {"qsgd": lambda: qsgd(error_feedback=True, block_size=64),
               "topk": lambda: topk(ratio=0.02),
               "powersgd": lambda: powersgd(rank=2, start_iteration=2)}[name]
    first = factory()
    model = _ddp(first)
    _steps(model, 3, seed=1)
    saved_state = first.state.state_dict()
    saved_weights = {k: v.clone() for k, v in model.module.state_dict().items()}
    expected = _steps(model, 3, seed=2)
    second = factory()
    second.state.load_state_dict(saved_state)
    net = _net()
    net.load_state_dict(saved_weights)
    resumed = _steps(_ddp(second, net), 3, seed=2)
    for step_expected, step_resumed in zip(expected, resumed, strict=True):
        for a, b in zip(step_expected, step_resumed, strict=True):
            torch.testing.assert_close(b, a, rtol=1.3e-6, atol=1e-5)
    assert second.state.totals()["bytes_sent"] == first.state.totals()["bytes_sent"]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_saved_state_loads_with_weights_only(name, one_rank_group, tmp_path):
    """Lightning loads checkpoints with ``weights_only=True``: the state must be plain data."""
    hook = FACTORIES[name]()
    _steps(_ddp(hook), 4)
    torch.save(hook.state.state_dict(), tmp_path / "state.pt")
    restored = FACTORIES[name]()
    restored.state.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.state.totals() == hook.state.totals()


# --- config errors ------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["compression=topk", "compression.ratio=0"],
     "compression.ratio=0 is not valid: expected a number > 0 and <= 1"),
    (["compression=qsgd", "compression.levels=200"],
     "compression.levels=200 is not valid: expected an int >= 1 and <= 127"),
    (["compression=powersgd", "compression.start_iteration=1"],
     "compression.start_iteration=1 is not valid with error_feedback or warm_start: expected >= 2"),
    (["compression=topk", "compression.error_feedback=maybe"],
     "compression.error_feedback='maybe' is not valid: expected true or false"),
])
def test_bad_compression_values_are_one_line_errors(overrides, message, tmp_path, outputs_root):
    cfg, choices = compose_job(["strategy=ddp", *overrides], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_batched_powersgd_refused_where_torch_breaks_it(tmp_path, outputs_root):
    from litscale.compression.factories import _batched_powersgd_works

    if _batched_powersgd_works():
        pytest.skip("this torch's batched_powerSGD_hook works")
    cfg, choices = compose_job(["strategy=ddp", "compression=powersgd", "compression.batched=true"],
                               tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^compression.batched=true is not available with torch"):
        validate(cfg, choices=choices)


def test_compression_on_single_process_strategy_is_refused(tmp_path, outputs_root):
    cfg, choices = compose_job(["compression=powersgd"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^compression=powersgd is not supported with strategy=single: it has no compression option; allowed: "):
        validate(cfg, choices=choices)


def test_a_move_to_another_world_size_gives_each_rank_the_saved_ranks_mean_error_feedback():
    """Every hook averages what the ranks send, so the update had not yet received the mean of
    the ranks' residuals: each rank of the new layout resumes with that mean (before, with
    zeros). Counters and PowerSGD's shared factors are rank 0's; its per-bucket batched errors
    belong to the old buckets and are dropped."""
    from litscale.callbacks.communication import CommunicationCallback

    class Recorded:
        def load_state_dict(self, state):
            self.loaded = state

    class Hook:
        state = Recorded()

    saved = [{"steps": 7, "residuals": {"w": torch.full((2, 2), float(r)), "b": torch.tensor([2.0 * r])},
              "errors": {"w": torch.tensor([r + 1.0])}, "low_rank": {"w": ("p", "q")}, "batched": {0: "old"}}
             for r in range(3)]
    hook = Hook()
    with pytest.warns(UserWarning, match="saved by 3 ranks and is resumed on 1: each rank's error feedback starts "
                                         "from the saved ranks' mean"):
        CommunicationCallback(compression=hook).load_state_dict({"ranks": saved})
    loaded = hook.state.loaded
    assert torch.equal(loaded["residuals"]["w"], torch.full((2, 2), 1.0))  # (0 + 1 + 2) / 3
    assert torch.equal(loaded["residuals"]["b"], torch.tensor([2.0]))
    assert torch.equal(loaded["errors"]["w"], torch.tensor([2.0]))
    assert (loaded["steps"], loaded["low_rank"], loaded["batched"]) == (7, {"w": ("p", "q")}, {})
