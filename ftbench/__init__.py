"""ftbench: fault-tolerance strategies for pipeline-parallel GPT training, on one engine.

The top-level folders `strategies/` and `models/` of a source checkout are the subpackages
`ftbench.strategies` and `ftbench.models`: a wheel installs them there (pyproject.toml maps
them), and in a checkout this package's path also covers the checkout's root, so the same
imports work without installing.
"""
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "strategies" / "__init__.py").is_file() \
        and not (_Path(__file__).resolve().parent / "strategies").exists():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
