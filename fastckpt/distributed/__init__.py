"""Checkpoints across ranks and nodes: the process group checkpoint collectives run on,
where each rank stands (its node), and the multi-rank paths built on them (asynchronous
collective saves, read-once loads, peer replication of the fast tier).

This layer sits above the single-file checkpoint code and below the series and the
integrations; it adds no transport of its own (torch.distributed: gloo on CPU, NCCL on GPU).
"""
