"""Which ranks hold a copy of which rank's fast-tier files: peer choice for replication.

Every node sends its ranks' files to ``k`` other nodes and receives from ``k`` others (a
balanced ring), so each node holds at most ``k`` peers' shares whatever the world size. The
ring interleaves failure domains (``FASTCKPT_FAILURE_DOMAIN``: a rack, a power feed, a
switch), so a node's next ``k`` nodes on it lie in other domains whenever there are enough
domains: losing a whole domain then loses no step whose replicas sit elsewhere.

A rank's replica goes to the rank of the same local index on the peer node (modulo that
node's rank count), so the traffic of one node is spread over the peer's ranks.

Example (4 ranks on 2 nodes, one replica each: node 0's ranks send to node 1's and back):
    >>> choose_peers([0, 0, 1, 1], 1)
    [[2], [3], [0], [1]]
    >>> ring([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"})  # domains alternate
    [0, 2, 1, 3]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["DOMAIN_VARIABLE", "choose_peers", "failure_domain", "ring"]

#: The environment variable that names a rank's failure domain (unset: its own node's).
DOMAIN_VARIABLE = "FASTCKPT_FAILURE_DOMAIN"


def failure_domain(environ: Mapping[str, str] | None = None) -> str:
    """This process's failure domain, from ``FASTCKPT_FAILURE_DOMAIN`` ('' when unset).

    Example:
        >>> failure_domain({"FASTCKPT_FAILURE_DOMAIN": "rack-3"})
        'rack-3'
    """
    env = os.environ if environ is None else environ
    return env.get(DOMAIN_VARIABLE, "")


def ring(nodes: Sequence[int], domains: Mapping[int, str] | None = None) -> list[int]:
    """The nodes in ring order: domains interleaved (the first node of each domain, then
    the second of each, ...), so neighbours on the ring lie in different domains when
    there are enough of them. Without domains, the nodes ascending.

    Example:
        >>> ring([0, 1, 2, 3, 4, 5], {n: "ab"[n // 3] for n in range(6)})
        [0, 3, 1, 4, 2, 5]
    """
    ordered = sorted(set(nodes))
    if not domains:
        return ordered
    by_domain: dict[str, list[int]] = {}
    for node in ordered:
        by_domain.setdefault(domains.get(node, ""), []).append(node)
    # the largest domains first: a domain's nodes are spaced as widely as the others allow
    groups = sorted(by_domain.values(), key=lambda g: (-len(g), g[0]))
    return [g[i] for i in range(len(groups[0])) for g in groups if i < len(g)]


def choose_peers(
    node_of_rank: Sequence[int], replicas: int, domains: Mapping[int, str] | None = None
) -> list[list[int]]:
    """For every rank, the ``replicas`` ranks that hold copies of its files.

    Args:
        node_of_rank: each rank's node, in rank order.
        replicas: how many other nodes hold each rank's copy (``k``).
        domains: each node's failure domain (optional).

    Raises:
        ValueError: ``replicas`` is negative or not below the number of nodes.

    Example:
        >>> choose_peers([0, 1, 2], 2)
        [[1, 2], [2, 0], [0, 1]]
        >>> choose_peers([0, 1], 2)
        Traceback (most recent call last):
        ...
        ValueError: replicas=2 needs at least 3 nodes (each copy on another node); this run has 2
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}")
    order = ring(node_of_rank, domains)
    if replicas > len(order) - 1:
        raise ValueError(
            f"replicas={replicas} needs at least {replicas + 1} nodes (each copy on another "
            f"node); this run has {len(order)}"
        )
    ranks_of: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        ranks_of.setdefault(node, []).append(rank)
    position = {node: i for i, node in enumerate(order)}
    peers = []
    for rank, node in enumerate(node_of_rank):
        local = ranks_of[node].index(rank)
        mine = []
        for j in range(1, replicas + 1):
            target = ranks_of[order[(position[node] + j) % len(order)]]
            mine.append(target[local % len(target)])
        peers.append(mine)
    return peers
