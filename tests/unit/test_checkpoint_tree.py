"""elaunch.checkpoint._tree: a state's structure as a pickle, its tensors as references (pure logic, no files)."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")

from elaunch.checkpoint import _tree  # noqa: E402
from elaunch.checkpoint._read import target_device  # noqa: E402

Point = collections.namedtuple("Point", "x y")


def round_trip(state):
    """Pack ``state``, lay its tensors into one byte buffer as a slot would, unpack from there."""
    packed = _tree.pack(state)
    data = torch.zeros(packed.data_len, dtype=torch.uint8)
    for t, ref in packed.tensors:
        assert ref.offset % _tree.TENSOR_ALIGN == 0
        data[ref.offset:ref.offset + ref.nbytes].view(t.dtype).view(t.shape).copy_(t)
    return _tree.unpack(packed.meta, lambda ref: data[ref.offset:ref.offset + ref.nbytes]
                        .view(ref.torch_dtype).view(ref.shape).clone())


def test_containers_and_leaves_come_back_as_they_were():
    state = {
        "od": collections.OrderedDict(b=torch.arange(6.0).view(2, 3).t(), a=1),
        "d": {3: [torch.ones(2, dtype=torch.bfloat16)]},
        "tup": (torch.tensor(True), "s", None, 2.5),
        "nt": Point(torch.zeros(0), b"x"),
    }
    with torch.serialization.safe_globals([Point]):  # a user's type: allowed
        out = round_trip(state)
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert torch.equal(out["od"]["b"], state["od"]["b"]) and out["od"]["b"].is_contiguous()
    assert out["d"][3][0].dtype == torch.bfloat16
    assert out["tup"][1:] == ("s", None, 2.5) and out["tup"][0].item() is True
    assert type(out["nt"]) is Point and out["nt"].x.shape == (0,)


def test_a_tensor_saved_twice_comes_back_once_and_empty_tensors_are_distinct():
    w, e1, e2 = torch.randn(4), torch.empty(0), torch.empty(0, 2)
    out = round_trip({"a": w, "tied": w, "e1": e1, "e2": e2, "s": torch.tensor(7)})
    assert out["a"] is out["tied"]
    assert out["e1"].shape == (0,) and out["e2"].shape == (0, 2) and out["s"].item() == 7
    packed = _tree.pack({"a": w, "tied": w})
    assert len(packed.tensors) == 1 and packed.data_len == 64


def test_parameters_and_requires_grad_survive():
    p, frozen, g = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2), requires_grad=False), \
        torch.ones(3, requires_grad=True)
    out = round_trip([p, frozen, g, torch.ones(1)])
    assert isinstance(out[0], torch.nn.Parameter) and out[0].requires_grad
    assert isinstance(out[1], torch.nn.Parameter) and not out[1].requires_grad
    assert not isinstance(out[2], torch.nn.Parameter) and out[2].requires_grad
    assert not out[3].requires_grad


class _Holder:
    def __init__(self, t):
        self.t = t


def test_a_users_object_holding_a_tensor_is_kept():
    with torch.serialization.safe_globals([_Holder]):
        out = round_trip({"h": _Holder(torch.full((3,), 2.0))})
    assert isinstance(out["h"], _Holder) and torch.equal(out["h"].t, torch.full((3,), 2.0))


@pytest.mark.parametrize("state, path", [
    ({"optimizer": {"param_groups": [{"lr": 0.1, "fn": lambda x: x}]}}, "state['optimizer']['param_groups'][0]['fn']"),
    ([1, (2, __import__("threading").Lock())], "state[1][1]"),
    ({0: {"sp": torch.eye(2).to_sparse()}}, "state[0]['sp']"),
    (lambda: 0, "state"),
])
def test_a_leaf_that_cannot_be_saved_is_named_by_its_key_path(state, path):
    with pytest.raises(TypeError) as err:
        _tree.pack(state)
    assert f"cannot save {path} (" in str(err.value)


def test_a_local_container_type_is_named_when_its_leaves_are_fine():
    class Local(dict):
        pass

    with pytest.raises(TypeError, match=r"cannot save state\['x'\] \(a Local\)"):
        _tree.pack({"x": Local(a=torch.ones(1))})


def test_a_class_held_as_a_value_is_checked_even_after_an_allowed_one_passed():
    """The save-time check is skipped only for the same set of types: two classes held as values differ."""
    import argparse

    _tree.pack({"c": torch.Size, "w": torch.ones(1)})  # torch allows torch.Size
    with pytest.raises(TypeError, match="Namespace"):
        _tree.pack({"c": argparse.Namespace, "w": torch.ones(1)})


@pytest.mark.parametrize("saved, map_location, want", [
    ("cpu", None, "cpu"),
    ("cuda:1", None, "cuda:1"),
    ("cuda:1", "cpu", "cpu"),
    ("cuda:1", torch.device("cpu"), "cpu"),
    ("cuda:1", {"cuda:1": "cuda:0"}, "cuda:0"),
    ("cpu", {"cuda:1": "cuda:0"}, "cpu"),
])
def test_map_location_reads_like_torch_load(saved, map_location, want):
    assert target_device(saved, map_location) == torch.device(want)


def test_map_location_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="map_location"):
        target_device("cpu", 3)


class _MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize("tensor, why", [
    (torch.ones(3).as_subclass(_MyTensor), "a tensor subclass (tests.unit.test_checkpoint_tree._MyTensor)"),
    (torch.zeros(4, dtype=torch.uint4), "dtype torch.uint4 is one of torch's shell dtypes"),
])
def test_a_tensor_that_would_not_come_back_is_refused_at_the_save_by_its_key_path(tensor, why):
    """A tensor subclass passed the save and came back a plain tensor from memory, or failed every load of a
    torch.save file (UnsafeStateError): it is a TypeError at the first save now, as the docs promise for what
    would not load. A shell dtype (uint4) raised NotImplementedError from the copy into the slot."""
    with pytest.raises(TypeError) as err:
        _tree.pack({"w": tensor})
    assert "cannot save state['w'] (" in str(err.value) and why in str(err.value)
    _tree.pack({"w": torch.nn.Parameter(torch.ones(2)), "v": torch.zeros(4, dtype=torch.uint4).view(torch.uint8)})
