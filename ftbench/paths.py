"""Where the configs live: `ftbench/conf` inside an installed package (package data), the
checkout's `conf/` in a source checkout."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"
TRACES_DIR = CONF_DIR / "traces"
