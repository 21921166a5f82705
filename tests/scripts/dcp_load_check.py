"""Load a DCP directory with DCP's own ``FileSystemReader``, no elaunch, and compare it with the expected state.

``dcp_load_check.py DIR EXPECTED OUT``, run as plain processes: ``WORLD_SIZE`` 1 (no process
group, a plain model) or more (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set; gloo, the
model ``fully_shard``ed over ``WORLD_SIZE`` ranks, so DCP reshards what 2 ranks saved).
A fresh model and Adam optimizer (state made by ``get_state_dict``) are filled by
``dcp.load(state, storage_reader=FileSystemReader(DIR))``; ``OUT/check_<rank>.txt``
gets ``ok N`` (N values compared, each equal to ``EXPECTED``'s) or the differences.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_persist import flatten, make_model  # noqa: E402


def main() -> None:
    path, expected_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    assert not any(k.startswith("ELAUNCH_") for k in os.environ), "run without elaunch"
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    model = make_model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    fresh = flatten(state)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = flatten({"model": get_state_dict(model, optim)[0], "optim": get_state_dict(model, optim)[1]})
    expected = torch.load(expected_path, weights_only=True)
    problems = []
    if set(got) != set(expected):
        problems.append(f"keys differ: {sorted(set(got) ^ set(expected))}")
    for key in sorted(set(got) & set(expected)):
        a, b = got[key], expected[key]
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
                problems.append(f"{key}: {a!r} != {b!r}")
        elif a != b:
            problems.append(f"{key}: {a!r} != {b!r}")
    changed = [k for k, v in expected.items() if isinstance(v, torch.Tensor) and k in fresh
               and isinstance(fresh[k], torch.Tensor) and fresh[k].shape == v.shape and not torch.equal(fresh[k], v)]
    if not changed:
        problems.append("no tensor differs from the fresh state: the check proves nothing")
    with open(os.path.join(out, f"check_{rank}.txt"), "w") as f:
        f.write("\n".join(problems) if problems else f"ok {len(expected)}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)

