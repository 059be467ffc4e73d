"""A plugin module (``plugins=[crash_plugin]``) that crashes every trainer rank with an untyped exception.

Test-only fault injection for the error-line test: the CLI imports it to validate (nothing happens there);
a trainer rank (torchrun's ``RANK`` set, running ``areal_cli.trainer.entry``) imports it when it reads the
run's config and dies of a RuntimeError with a real traceback in its log, as a bug in a trainer would.
"""

from __future__ import annotations

import os
import sys

CRASH_MESSAGE = "injected crash in a trainer rank (tests/support/crash_plugin.py)"


def _crash_here() -> None:
    raise RuntimeError(CRASH_MESSAGE)


if os.environ.get("RANK") is not None and sys.argv[0].endswith(os.path.join("trainer", "entry.py")):
    _crash_here()
