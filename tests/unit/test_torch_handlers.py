"""The adapter of torchrun.handlers plugins: torch's errors and parameters at the boundary (pure logic)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import api as tapi

from elaunch.rendezvous import contract
from elaunch.rendezvous.torch_handlers import TorchHandlerAdapter, torch_parameters


class Raising(tapi.RendezvousHandler):
    """A torch handler whose every call raises ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    def get_backend(self):
        return "x"

    def next_rendezvous(self):
        raise self.exc

    def is_closed(self):
        raise self.exc

    def set_closed(self):
        raise self.exc

    def num_nodes_waiting(self):
        raise self.exc

    def get_run_id(self):
        return "job"

    def shutdown(self):
        raise self.exc


def params(**conf):
    return contract.RendezvousParameters("x", "h:1", "job", 1, 2, config=conf, local_addr="me")


@pytest.mark.parametrize("theirs, ours", [
    (tapi.RendezvousClosedError(), contract.RendezvousClosedError),
    (tapi.RendezvousTimeoutError("late"), contract.RendezvousTimeoutError),
    (tapi.RendezvousConnectionError("gone"), contract.RendezvousConnectionError),
    (tapi.RendezvousStateError("bad"), contract.RendezvousStateError),
    (tapi.RendezvousGracefulExitError(), contract.RendezvousGracefulExitError),
    (tapi.RendezvousError("other"), contract.RendezvousError),
])
def test_torch_errors_become_elaunch_errors_chained(theirs, ours):
    adapter = TorchHandlerAdapter(Raising(theirs), params())
    for call in (adapter.next_rendezvous, adapter.num_nodes_waiting, adapter.is_closed, adapter.set_closed):
        with pytest.raises(ours, match="--rdzv-backend=x: ") as info:
            call()
        assert info.value.__cause__ is theirs


def test_other_errors_pass_through():
    with pytest.raises(ZeroDivisionError):
        TorchHandlerAdapter(Raising(ZeroDivisionError()), params()).next_rendezvous()


def test_torch_parameters_as_torchrun_builds_them():
    elaunch_params = params(is_host="1", timeout="30")
    t = torch_parameters(elaunch_params)
    assert (t.backend, t.endpoint, t.run_id, t.min_nodes, t.max_nodes, t.local_addr) == ("x", "h:1", "job", 1, 2, "me")
    assert t.config == {"is_host": "1", "timeout": "30"}
    assert elaunch_params.unused_keys() == []  # the creator gets every key
    assert torch_parameters(params()).config == {"timeout": 900}  # torch's LaunchConfig default
