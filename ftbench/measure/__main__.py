"""`python -m ftbench.measure`: the same as `ftbench calibrate`."""
import sys

from ftbench.measure.cli import main

sys.exit(main())
