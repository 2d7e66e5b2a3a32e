"""`python -m client`: see client/cli.py."""

from __future__ import annotations

import sys

from client.cli import main

sys.exit(main())
