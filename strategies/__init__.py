"""Fault-tolerance strategies, by name. Each module reads like its paper's mechanism section."""
from __future__ import annotations

from ftbench.errors import ConfigError
from strategies.base import Recovery, Strategy
from strategies.none import NoFaultTolerance

REGISTRY: dict[str, type] = {"none": NoFaultTolerance}


def build_strategy(cfg, ctx) -> Strategy:
    name = cfg.name
    if name not in REGISTRY:
        raise ConfigError("strategy", f"unknown strategy '{name}'", f"choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name](cfg, ctx)


__all__ = ["REGISTRY", "Recovery", "Strategy", "build_strategy"]
