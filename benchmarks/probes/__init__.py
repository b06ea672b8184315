"""Probes the docs cite, each for one finding that its docstring states: not part of ``make bench``.

* ``copy_speed``: memory copy speed differs by process on the reference VM and changes within one.
* ``restore_ab``: zerostall's load modes, the read floors and safetensors, paired in one process.
* ``cold_read_probe``: where a cold load's time goes, against a raw read of the same file.
* ``memcopy_probe``: zerostall's copy and checksum kernels against ``memmove``.
* ``s3_bench``: zerostall against S3 against raw boto3 on the same bytes.
* ``jax_stall``: how long a save blocks a JAX trainer on CPU, background copy against blocking.
* ``data_access``: what ordering ``Tensor.data`` after an overlapped copy costs a save and an access.
"""
