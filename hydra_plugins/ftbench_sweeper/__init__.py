"""Hydra finds sweepers only in the `hydra_plugins` namespace package: this is where the
paper tables' sweeper (`hydra/sweeper=ftbench`, ftbench/sweeper.py) is made known to it."""
