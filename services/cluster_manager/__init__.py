"""Cluster manager: membership and health of JEs and TEs, the model registry, and the
cluster view pushed to everybody on every change."""
