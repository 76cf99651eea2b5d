"""Where a training run's ranks ran: each rank's node, gathered in rank order, for the run's lineage.

On an autoscaling cluster the nodes that train may not exist when the run starts; recording them on the training
run lets a user see the scale-up (and which machines to look at when a rank misbehaved).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from infra.names import TAG_TRAIN_NODE_IDS

NODE_NAME_BYTES = 256  # a Ray node id is 56 hex characters; a host name is at most 255 bytes
MAX_TAG_CHARS = 5000  # well inside MLflow's tag value limit


def this_node() -> str:
    """This process's node: the Ray node id inside a Ray worker (what `ray.nodes()` lists), else the host name."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:  # torchrun without Ray installed
        pass
    return socket.gethostname()


def gather_nodes(device: torch.device) -> list[str]:
    """Every rank's node, in rank order. A collective: every rank calls it.

    Names travel as fixed-size byte tensors (no pickled objects between processes).
    """
    name = this_node().encode()[:NODE_NAME_BYTES]
    mine = torch.zeros(NODE_NAME_BYTES, dtype=torch.uint8)
    mine[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in everyone]


def placement_lineage(nodes: list[str]) -> tuple[dict[str, str], dict[str, float]]:
    """MLflow (tags, metrics) of a placement: the distinct nodes in order of their first rank, and their count."""
    distinct = list(dict.fromkeys(nodes))
    joined = ",".join(distinct)
    if len(joined) > MAX_TAG_CHARS:  # thousands of nodes: keep the count exact, the list readable
        joined = joined[: MAX_TAG_CHARS - 20].rsplit(",", 1)[0] + f",... ({len(distinct)} nodes in all)"
    return {TAG_TRAIN_NODE_IDS: joined}, {"train_nodes": float(len(distinct)), "train_ranks": float(len(nodes))}
