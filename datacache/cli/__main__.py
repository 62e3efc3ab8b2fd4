"""``python -m datacache.cli``: the ``datacache`` command."""
import sys

from .main import main

sys.exit(main())
