"""`hydra/sweeper=ftbench` as Hydra loads it; the logic is ftbench.sweeper.CellSweeper."""
from ftbench.sweeper import CellSweeper as _CellSweeper


class CellSweeper(_CellSweeper):
    """Hydra's basic sweeper minus excluded combinations, with one progress bar (ftbench/sweeper.py)."""
