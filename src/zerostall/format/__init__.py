"""The on-disk format, in one place: the layout's names and patterns (:mod:`.layout`), the
safetensors header codec of the data files (:mod:`.header`) and the manifest (:mod:`.manifest`).

Every other module that reads or writes a checkpoint's files takes the names, patterns and
encodings from here; docs/format.md describes what they spell. This package module imports
nothing, so that the storage backends can use :mod:`.layout` (which imports nothing of
zerostall) without loading the codecs.
"""
