"""Input agreement over the gloo twin of a process group: no GPU involved, only its ranks."""

import socket

import torch.distributed as dist

from mok.distributed import agree_or_raise, gloo_twin, host_names
from mok.errors import MoKInputError
from mok.ranks import run_ranks


def agree(rank, world):
    """Rank 1 of a sub-group of ranks 0 and 1 rejects its input; rank 2 is not in the group."""
    group = dist.new_group([0, 1])
    if rank == 2:
        return "outside"
    twin = gloo_twin(group)
    assert twin.size() == 2 and twin.rank() == rank
    try:
        agree_or_raise("bad input" if rank == 1 else None, twin)
    except MoKInputError as error:
        return str(error)
    return "no error"


def test_a_rejection_on_one_rank_raises_on_every_rank_of_the_group():
    outcomes = run_ranks(agree, 3)
    assert outcomes[0].startswith("rank(s) [1]")
    assert outcomes[1] == "bad input"
    assert outcomes[2] == "outside"


def names(rank, world):
    return host_names(dist.group.WORLD), host_names(gloo_twin(dist.group.WORLD))


def test_host_names_of_every_rank():
    for on_group, on_twin in run_ranks(names, 2):
        assert on_group == on_twin == [socket.gethostname()] * 2
