"""The copy a background save writes (``litscale.checkpoint.background.KeptCopies``): what the
checkpoint held when the save began, whatever training does to it next, in the memory of the
last copy."""

from __future__ import annotations

import torch

from litscale.checkpoint.background import KeptCopies


def checkpoint(step: int) -> dict:
    torch.manual_seed(step)
    weight = torch.randn(4, 3)
    return {
        "state_dict": {"wte.weight": weight, "lm_head.weight": weight, "ln.bias": torch.zeros(3)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(4, 3)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "loops": {"seen": [1, 2, step]},
        "shapes": (torch.ones(2), "text"),
        "global_step": step,
    }


def test_the_copy_keeps_what_the_checkpoint_held_when_the_save_began():
    original = checkpoint(1)
    copied = KeptCopies(pinned=False).copy(original)
    expected = checkpoint(1)
    original["state_dict"]["wte.weight"].add_(1.0)  # the next step, in place
    original["optimizer_states"][0]["state"][0]["exp_avg"].zero_()
    original["loops"]["seen"].append(4)
    assert torch.equal(copied["state_dict"]["wte.weight"], expected["state_dict"]["wte.weight"])
    assert torch.equal(copied["optimizer_states"][0]["state"][0]["exp_avg"],
                       expected["optimizer_states"][0]["state"][0]["exp_avg"])
    assert copied["loops"] == {"seen": [1, 2, 1]} and copied["global_step"] == 1
    assert isinstance(copied["shapes"], tuple) and copied["shapes"][1] == "text"
    assert copied["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_tied_tensors_stay_one_tensor_as_torch_save_keeps_them(tmp_path):
    copied = KeptCopies(pinned=False).copy(checkpoint(1))
    assert copied["state_dict"]["wte.weight"] is copied["state_dict"]["lm_head.weight"]
    torch.save(copied, tmp_path / "last.ckpt")
    loaded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert loaded["state_dict"]["wte.weight"].untyped_storage().data_ptr() == \
        loaded["state_dict"]["lm_head.weight"].untyped_storage().data_ptr()


def test_each_save_copies_into_the_memory_of_the_last_and_a_new_shape_gets_its_own():
    copies = KeptCopies(pinned=False)
    first = copies.copy(checkpoint(1))
    place = first["optimizer_states"][0]["state"][0]["exp_avg"].data_ptr()
    second = copies.copy(checkpoint(2))
    assert second["optimizer_states"][0]["state"][0]["exp_avg"].data_ptr() == place
    assert torch.equal(second["optimizer_states"][0]["state"][0]["exp_avg"],
                       checkpoint(2)["optimizer_states"][0]["state"][0]["exp_avg"])
    grown = checkpoint(3)
    grown["state_dict"]["ln.bias"] = torch.arange(5.0)
    assert torch.equal(copies.copy(grown)["state_dict"]["ln.bias"], torch.arange(5.0))


def test_a_sharded_saves_shards_and_the_rest_of_its_checkpoint_are_copied_apart():
    """Both copies of one save are written after it returns: the rest's copy must not land in
    the staged shards' buffers (the same shape, the first tensor of each)."""
    from litscale.checkpoint.background import CheckpointWriter

    writer = CheckpointWriter()
    try:
        shards = writer.stager().stage({"state_dict": {"w": torch.ones(3)}})
        rest = writer.snapshot({"rng": torch.zeros(3)})
        assert torch.equal(shards["state_dict"]["w"], torch.ones(3)) and torch.equal(rest["rng"], torch.zeros(3))
    finally:
        writer.close()
