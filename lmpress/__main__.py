"""``python -m lmpress ...`` (what ``torchrun -m lmpress`` runs): the ``lmpress`` command."""

import sys

from lmpress.cli import main

sys.exit(main())
