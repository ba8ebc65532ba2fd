"""``python -m cospec ...`` (and ``torchrun --nproc-per-node N -m cospec train parallel.cp=N``)."""

import sys

from cospec.cli import main

sys.exit(main())
