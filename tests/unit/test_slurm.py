"""Reading a Slurm allocation."""

import socket

import pytest
from llmft.slurm import current_allocation, expand_nodelist, rendezvous_port


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b5,c[9]", ["a1", "a2", "b5", "c9"]),
        ("mi300x-[008-010]-ib", ["mi300x-008-ib", "mi300x-009-ib", "mi300x-010-ib"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_port_is_per_job_and_in_range():
    assert rendezvous_port("1234") != rendezvous_port("1235")
    assert 29500 <= rendezvous_port("987654") < 31500
    assert rendezvous_port(None) == 29500


def test_allocation_outside_slurm_is_one_local_node_on_a_free_port():
    alloc = current_allocation({})
    assert alloc.nnodes == 1 and alloc.node_rank == 0 and alloc.master_addr == "127.0.0.1"
    with socket.socket() as busy:  # a port another pipeline holds is never handed out
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(current_allocation({}).master_port != taken for _ in range(20))


def test_allocation_from_slurm_env():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURMD_NODENAME": "gpu03"}
    alloc = current_allocation(env)
    assert alloc.nodes == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert alloc.node_rank == 2 and alloc.master_port == rendezvous_port("77")


def test_allocation_refuses_unknown_node():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURMD_NODENAME": "other"}
    with pytest.raises(RuntimeError, match="cannot tell this node's rank"):
        current_allocation(env)
