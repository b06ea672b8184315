"""Persist: write staged bytes to storage, checksum them, commit. Never on the training thread.

The writer runs as a separate process (default) or a thread, speaking the same message
protocol over a socket pair either way (:mod:`zerostall.persist.server`,
:mod:`zerostall.persist.client`). Nothing is imported here: the writer process imports only
what writing needs, not the trainer's side (:class:`zerostall.persist.client.WriterClient`).
"""
