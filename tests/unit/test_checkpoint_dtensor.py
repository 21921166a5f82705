"""elaunch.checkpoint._tree: DTensor references as primitives (placements, meshes), checked when loaded.

No process group: the encoding is pure, and a reference that is not well formed is refused by the
weights-only path (``_tree.unpack``) before any DTensor is made.
"""

from __future__ import annotations

import io
import pickle

import pytest

torch = pytest.importorskip("torch")
dtensor = pytest.importorskip("torch.distributed.tensor")

from elaunch.checkpoint import CheckpointError, UnsafeStateError, _tree  # noqa: E402

MESH = ("cpu", (2,), ("dp",), (0, 1), 2, None)
MESH_2D = ("cpu", (1, 2), ("dp", "tp"), (0, 1), 2, None)
SUB = ("cpu", (2,), ("tp",), (0, 1), 2, MESH_2D)


def pid(**change):
    """A well-formed DTensor reference (a 3x4 float32 local shard of a 6x4 DTensor), with items changed."""
    fields = dict(offset=0, nbytes=48, dtype="float32", shape=(3, 4), device="cpu", grad=0, index=0,
                  gshape=(6, 4), gstride=(4, 1), placements=(("S", 0),), mesh=MESH)
    fields.update(change)
    return ("storage", "elaunch.dt1", *fields.values())


def meta_with(ref: tuple) -> bytes:
    """A meta whose only tensor stands for the persistent id ``ref`` (forged as a peer could)."""
    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return ref if isinstance(obj, torch.Tensor) else None

    buf = io.BytesIO()
    Forger(buf, protocol=_tree.PROTOCOL).dump({"w": torch.zeros(1)})
    return buf.getvalue()


def unpack(meta: bytes):
    return _tree.unpack(meta, lambda ref: torch.zeros(ref.shape, dtype=ref.torch_dtype))


@pytest.mark.parametrize("placement", [
    dtensor.Shard(1), dtensor.Replicate(), dtensor.Partial(), dtensor.Partial("avg"), dtensor.Partial("max"),
])
def test_placements_round_trip_as_primitives(placement):
    enc = _tree.encode_placement(placement)
    assert type(enc) is tuple and all(type(v) in (str, int) for v in enc)
    assert _tree._placement_ok(enc, 2)
    back = _tree.decode_placement(enc)
    assert back == placement and type(back) is type(placement)


def test_a_strided_shard_round_trips_and_other_placements_are_refused():
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = _StridedShard(0, split_factor=2)
    assert _tree.encode_placement(strided) == ("SS", 0, 2)
    assert _tree.decode_placement(("SS", 0, 2)) == strided
    with pytest.raises(TypeError, match="Shard, Replicate and Partial placements only"):
        _tree.encode_placement(object())


@pytest.mark.parametrize("mesh", [MESH, MESH_2D, SUB, ("cuda", (2,), None, (1, 0), 2, None)])
def test_well_formed_references_are_read_back_field_by_field(mesh):
    placements = (("R",),) * (len(mesh[1]) - 1) + (("S", 0),)
    ref = _tree.TensorRef.from_pid(pid(mesh=mesh, placements=placements))
    assert ref.shape == (3, 4) and ref.dt == ((6, 4), (4, 1), placements, mesh)
    assert ref.pid() == pid(mesh=mesh, placements=placements)  # the same tuple back: old plain tags untouched
    plain = _tree.TensorRef(0, 48, "float32", (3, 4), "cpu")
    assert plain.pid()[:2] == ("storage", "elaunch.t2") and len(plain.pid()) == 9


@pytest.mark.parametrize("change", [
    dict(placements=(("S", 2),)),  # a dim the tensor does not have
    dict(placements=(("S", True),)),  # a bool is not an int
    dict(placements=(("P", "os.system"),)),  # not a reduce op
    dict(placements=(("X",),)),
    dict(placements=(("R",), ("R",))),  # two placements on a 1-D mesh
    dict(placements=(("SS", 0, 0),)),  # split factor 0
    dict(gshape=(6,)),  # global and local shapes of different dims
    dict(gstride=(4,)),
    dict(nbytes=47),
    dict(mesh=("cpu", (2,), ("dp",), (0,), 2, None)),  # fewer ranks than the shape holds
    dict(mesh=("cpu", (2,), ("dp",), (0, 2), 2, None)),  # a rank beyond the world
    dict(mesh=("cpu", (2,), ("dp", "tp"), (0, 1), 2, None)),  # names of another length
    dict(mesh=("cpu", (2,), ("dp",), (0, 1), 2, SUB)),  # a root that has a root
    dict(mesh=("cpu", (2,), ("dp",), (0, 1), 2)),
    dict(mesh=("cpu", (0,), ("dp",), (), 2, None)),
])
def test_malformed_dtensor_references_are_refused_by_the_weights_only_path(change):
    bad = pid(**change)
    with pytest.raises(pickle.UnpicklingError, match="malformed tensor reference"):
        _tree.TensorRef.from_pid(bad)
    with pytest.raises(UnsafeStateError, match="malformed tensor reference"):
        unpack(meta_with(bad))


def test_a_reference_of_another_length_is_not_an_elaunch_one():
    with pytest.raises(pickle.UnpicklingError, match="not an elaunch tensor reference"):
        _tree.TensorRef.from_pid(pid()[:12])
    with pytest.raises(pickle.UnpicklingError, match="not an elaunch tensor reference"):
        _tree.TensorRef.from_pid(("storage", "elaunch.t2", *pid()[2:]))  # the plain tag with DTensor items


def test_dtensors_are_not_made_without_torch_distributed_and_the_message_says_the_saved_world():
    with pytest.raises(CheckpointError) as got:
        unpack(meta_with(pid()))
    assert str(got.value) == (
        "the snapshot holds DTensors saved by a world of 2 ranks and torch.distributed is not initialized here: "
        "restore it at 2 ranks (after init_process_group), or reshard it through torch.distributed.checkpoint with "
        "elaunch.checkpoint.SnapshotReader")


def test_dtensor_entries_for_torch_save_files_round_trip_and_malformed_ones_are_refused():
    ref = _tree.TensorRef.from_pid(pid(grad=3))
    entry = _tree.as_entry(torch.arange(12.0).view(3, 4), ref)
    buf = io.BytesIO()
    torch.save({"w": entry}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]  # torch alone reads it
    assert _tree.entry_ref(back).dt == ref.dt and _tree.entry_ref(back).grad == 3
    assert _tree.decode_dtensors({"w": back}, None)["w"] is back  # no maker: left as it is
    for bad in ({**back, "placements": (("S", 5),)}, {**back, "extra": 1}, {**back, "local": 1.0}):
        with pytest.raises(pickle.UnpicklingError):
            _tree.entry_ref(bad)
        with pytest.raises(CheckpointError, match="cannot load a DTensor"):
            _tree.decode_dtensors({"w": bad}, None)
    with pytest.raises(CheckpointError, match="saved by a world of 2 ranks"):
        _tree.decode_dtensors({"w": back}, _tree.DTensorMaker())
