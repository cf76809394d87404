"""The served process's heap, settled once it has started."""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """What is alive once the app has started (modules, the app and its routes, the engine,
    the compiled statements: hundreds of thousands of objects that live as long as the
    process) is left out of the garbage collector's scans from now on, as the ``gc``
    documentation advises for a long-running process (``gc.freeze``). Without it every full
    collection walked all of them again (bench/README.md, section 8)."""
    gc.collect()
    gc.freeze()
