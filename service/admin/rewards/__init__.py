"""Reward semantics (DESIGN.md): the pure reward function, spec versions, replay."""
