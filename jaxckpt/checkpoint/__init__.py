"""The calls on one checkpoint: :class:`jaxckpt.Checkpoint` (named children, delayed restores, save
numbering), :func:`jaxckpt.save`, :func:`jaxckpt.restore` and its relatives, and
:func:`jaxckpt.restore_slots`.

May use :mod:`jaxckpt.saving`, :mod:`jaxckpt.reading` and the layers below; never
:mod:`jaxckpt.incremental`, its sibling.
"""
