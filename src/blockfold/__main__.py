"""``python -m blockfold`` (and ``torchrun ... -m blockfold``): the command line."""

import sys

from blockfold.cli import main

sys.exit(main())
