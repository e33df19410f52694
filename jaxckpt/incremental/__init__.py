"""Incremental saves: everything that decides reuse. What a manager last saved or restored (weak
references, files, CRCs), hard links on local disks, references to sibling checkpoints on buckets
and the data retention must hold for them, and what a two-tier copy already uploaded. A save sees it
only through :class:`jaxckpt.saving.reuse.Reuse`; a restore tells it through
``jaxckpt.reading.reader.LOAD_OBSERVERS``.

May use :mod:`jaxckpt.saving`, :mod:`jaxckpt.reading` and the layers below; never
:mod:`jaxckpt.checkpoint`, its sibling.
"""
