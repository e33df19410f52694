"""Array I/O: each data store's zarr3 sharded arrays and packs, written and read with a CRC-32C for
every inner chunk (jaxckpt's own code on local disks, TensorStore on buckets), its
``checksums.json``, and the bound on bytes in flight.

May use: :mod:`jaxckpt.runtime`, :mod:`jaxckpt.storage`, :mod:`jaxckpt.format`, and the shared modules.
"""
