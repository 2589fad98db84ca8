"""The TP group: its size and, across machines, how its nodes meet."""

from __future__ import annotations

from dataclasses import dataclass

from tpspec.config.checks import check_int

BACKENDS = ("auto", "gloo", "nccl")
# vLLM's default --master-port: where the head of a multi-node engine listens when none is given.
DEFAULT_MASTER_PORT = 29501


@dataclass(frozen=True)
class ParallelConfig:
    """The TP group: its size and, across machines (vLLM's multi-node flags), how its nodes meet.

    The ``tensor_parallel_size`` ranks are spread evenly over ``nnodes`` nodes: node r runs ranks
    ``r·n … r·n + n − 1`` with ``n = tensor_parallel_size / nnodes``; node 0 (the head) runs the
    engine and rank 0. Across nodes the head listens on ``master_addr:master_port`` for the other
    nodes and the torch.distributed rendezvous is on ``master_port + 1``.
    """

    tensor_parallel_size: int = 1
    backend: str = "auto"  # BACKENDS
    worker_timeout_s: float = 600.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free loopback port on one node, DEFAULT_MASTER_PORT across nodes
    distributed_timeout_s: float = 300.0  # the longest the head waits for the other nodes to join

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        check_int("nnodes", self.nnodes, 1, 64)
        check_int("node_rank", self.node_rank, 0)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1] = [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not divisible by nnodes={self.nnodes}: "
                "the ranks are spread evenly over the nodes"
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if self.master_port is not None:
            check_int("master_port", self.master_port, 1, 65534)  # the rendezvous takes master_port + 1
        if isinstance(self.distributed_timeout_s, bool) or not (
            isinstance(self.distributed_timeout_s, (int, float)) and self.distributed_timeout_s > 0
        ):
            raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got {self.distributed_timeout_s!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_ranks(self, node_rank: int | None = None) -> range:
        """The global TP ranks that run on ``node_rank`` (default: this node)."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
