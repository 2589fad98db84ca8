"""A node of a multi-node engine other than the head: ``tpspec serve --headless --node-rank r``.

It serves no API. It joins the head (``node_link.join_head``: the head compares the two
configurations and refuses a node that differs), starts this node's share of the TP ranks as
worker processes, and then only watches: it exits 0 when the head shuts the engine down, and 1
when the head goes away (its link closes or falls silent) or one of its own workers dies, which
it reports to the head first. Its workers die with it.
"""

from __future__ import annotations

import logging
import queue

from tpspec.config import EngineConfig
from tpspec.executor.fingerprint import config_fingerprint
from tpspec.executor.local_workers import EngineDeadError, LocalWorkers, check_cuda_devices
from tpspec.executor.node_link import LinkClosed, join_head

logger = logging.getLogger(__name__)

# How long a node's workers get to exit after the head's shutdown message before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0


def run_node(config: EngineConfig, device_kind: str) -> int:
    """Run node ``config.parallel.node_rank`` until the head stops; the exit status."""
    parallel = config.parallel
    if parallel.nnodes == 1 or parallel.node_rank == 0:
        raise ValueError(
            f"--headless runs one of the other nodes of a multi-node engine: it needs --nnodes > 1 and --node-rank "
            f">= 1, got --nnodes {parallel.nnodes} --node-rank {parallel.node_rank}"
        )
    check_cuda_devices(config, device_kind)
    link, init_method = join_head(parallel, config_fingerprint(config, device_kind))
    ranks = parallel.node_ranks()
    events: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
    workers = None
    try:
        workers = LocalWorkers(config, device_kind, ranks, init_method)
        try:
            workers.wait_until_joining(parallel.worker_timeout_s)
        except EngineDeadError as e:
            link.send("dead", reason=str(e))
            raise
        link.send("ready")
        workers.watch(lambda reason: events.put(("worker", reason)))
        link.watch(lambda msg: events.put(("shutdown", "")) if msg["type"] == "shutdown" else None,
                   lambda reason: events.put(("head", reason)))
        logger.info("node %d: running TP ranks %d-%d for %s", parallel.node_rank, ranks[0], ranks[-1], link.peer)
        kind, reason = events.get()
        if kind == "shutdown":
            codes = workers.stop(graceful=True, timeout_s=SHUTDOWN_TIMEOUT_S)
            logger.info("node %d: the head shut the engine down (worker exit codes %s)", parallel.node_rank, codes)
            return 0
        if kind == "worker":
            logger.error("node %d: %s; telling the head and stopping", parallel.node_rank, reason)
            try:
                link.send("dead", reason=reason)
            except LinkClosed:
                pass
        else:
            logger.error("node %d: %s: stopping this node's workers", parallel.node_rank, reason)
        return 1
    finally:
        if workers is not None:
            workers.stop(graceful=False)
        link.close()
