"""Fault-tolerance strategies, by name. Each module reads like its paper's mechanism section."""
from __future__ import annotations

from ftbench.errors import ConfigError
from ftbench.strategies.bamboo import Bamboo
from ftbench.strategies.base import Recovery, Strategy
from ftbench.strategies.checkfreq import CheckFreq
from ftbench.strategies.checkpoint import CheckpointRestart
from ftbench.strategies.elastic_horovod import ElasticHorovod
from ftbench.strategies.none import NoFaultTolerance
from ftbench.strategies.oobleck import Oobleck
from ftbench.strategies.recycle import ReCycle
from ftbench.strategies.swift import Swift
from ftbench.strategies.varuna import Varuna

REGISTRY: dict[str, type] = {cls.name: cls for cls in (NoFaultTolerance, CheckpointRestart, CheckFreq,
                                                       ElasticHorovod, Varuna, ReCycle, Oobleck, Bamboo, Swift)}


def build_strategy(cfg, ctx) -> Strategy:
    name = cfg.name
    if name not in REGISTRY:
        raise ConfigError("strategy", f"unknown strategy '{name}'", f"choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name](cfg, ctx)


__all__ = ["REGISTRY", "Recovery", "Strategy", "build_strategy"]
