"""Fault-tolerance strategies, by name. Each module reads like its paper's mechanism section.

Every module of this package registers its strategy on import (`@register`,
ftbench/strategies/base.py); a strategy from another package registers through the entry
point group `ftbench.strategies` (`name = "package.module:Class"` in its pyproject.toml) and
is then `strategy=<name>` like the built-in ones (docs/extending.md)."""
from __future__ import annotations

import importlib
import pkgutil
import sys
from importlib.metadata import entry_points

from ftbench.errors import ConfigError
from ftbench.strategies.base import REGISTRY, Recovery, Strategy, StrategyConfig, StrategyTests, register

ENTRY_POINTS = "ftbench.strategies"

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")


def load_entry_points() -> list[str]:
    """Register the strategies other installed packages declare (group `ftbench.strategies`);
    their names."""
    names = []
    for point in entry_points(group=ENTRY_POINTS):
        module = sys.modules.get(point.module)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
            # its module is being imported and imported this package first (a plugin imported on
            # its own, as a process that unpickles its class does): its @register runs once its
            # import ends, else a later strategy_class() loads it
            continue
        try:
            cls = point.load()
        except Exception as err:  # a broken plugin must say which one, not break every run
            raise ConfigError("strategy", f"the strategy entry point '{point.name} = {point.value}' does not load: "
                              f"{type(err).__name__}: {err}", "fix or uninstall the package that declares it") from err
        register(cls)
        names.append(cls.name)
    return names


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy `name` (a ConfigError naming the choices otherwise)."""
    if str(name) not in REGISTRY:
        load_entry_points()  # a plugin skipped while it was being imported
    if str(name) not in REGISTRY:
        raise ConfigError("strategy", f"unknown strategy '{name}'", f"choose one of {', '.join(REGISTRY)}")
    return REGISTRY[str(name)]


def build_strategy(cfg, ctx) -> Strategy:
    return strategy_class(cfg.name)(cfg, ctx)


load_entry_points()

__all__ = ["REGISTRY", "Recovery", "Strategy", "StrategyConfig", "StrategyTests", "build_strategy",
           "load_entry_points", "register", "strategy_class"]
