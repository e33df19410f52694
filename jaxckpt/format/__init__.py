"""The format: what the bytes of a checkpoint mean. The index's records and constants, keys and node
records, the index as canonical JSON (written checksummed, parsed defensively), ``refs.json``.

No I/O: these modules turn records into bytes and bytes into checked records. The bottom layer:
may use only the shared modules (``jaxckpt._errors``, ``jaxckpt._gc_pause``).
"""
