"""``python -m clova_train`` is the ``clova-train`` command."""

import sys

from clova_train.cli import main

sys.exit(main())
