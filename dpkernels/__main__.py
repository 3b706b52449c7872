"""``python -m dpkernels``: the same command line as the ``dpkernels`` script."""

import sys

from .cli import main

sys.exit(main())
