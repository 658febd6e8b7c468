"""Prismatic / OpenVLA release-compatible modules: vision towers, projector, actions, preprocessing."""
