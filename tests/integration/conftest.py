"""Integration tests against real trainers (torchtitan, Lightning, transformers/accelerate).

Not part of the default ``python -m pytest tests`` run: they need packages the library does not depend on and take
minutes. Opt in with ``FSDP_COMPOSE_INTEGRATION=1`` (``nox -s integration`` sets it and installs the packages); a
file whose package is missing is skipped.
"""

from __future__ import annotations

import os

if os.environ.get("FSDP_COMPOSE_INTEGRATION") != "1":
    collect_ignore_glob = ["test_*.py"]
