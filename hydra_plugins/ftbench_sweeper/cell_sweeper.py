"""`hydra/sweeper=ftbench` as Hydra loads it; the logic is ftbench.sweeper.CellSweeper."""
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins

from ftbench.sweeper import CellSweeper as _CellSweeper
from ftbench.sweeper import CellSweeperConf


class CellSweeper(_CellSweeper):
    """Hydra's basic sweeper minus excluded combinations, with one progress bar (ftbench/sweeper.py)."""


def register() -> None:
    """Make `hydra/sweeper=ftbench` known. Hydra loads plugins only from the `hydra_plugins`
    namespace and finds them by scanning it, which misses packages installed in editable mode
    (`pip install -e .`): the class is registered here by hand as well."""
    ConfigStore.instance().store(group="hydra/sweeper", name="ftbench", node=CellSweeperConf)
    Plugins.instance().register(CellSweeper)
