"""Persist: write staged bytes to storage, checksum them, commit. Never on the training thread.

The writer runs as a separate process (default) or a thread, speaking the same message
protocol over a socket pair either way (:mod:`zerostall.persist.server`,
:mod:`zerostall.persist.client`).
"""

from zerostall.persist.client import WriterClient

__all__ = ["WriterClient"]
