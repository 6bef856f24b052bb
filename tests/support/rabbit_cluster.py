"""A RabbitMQ cluster of its own on this machine, for the test that stops one of its
nodes under the daemons. The nodes are started by :mod:`harness.rabbit_node`, which the
chaos run's private broker uses too."""

from __future__ import annotations

from harness.rabbit_node import (
    ClusterError,
    Node,
    RabbitCluster,
    installed,
    rabbit_cluster,
    script,
)

__all__ = ["ClusterError", "Node", "RabbitCluster", "installed", "rabbit_cluster", "script"]
