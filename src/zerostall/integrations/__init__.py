"""Integrations with training frameworks, each a thin layer over the public ``zerostall`` API.

Nothing is imported here, so that ``import zerostall`` never pulls in a framework; import the
integration you need (``from zerostall.lightning import ZerostallCheckpointIO``).
"""
