"""A read: which checkpoint a path names and in which format, one checkpoint opened (its index, its
folder held open), read plans, batched checked reads, templates' checks and casts, arrays placed on
devices; arrays stored by reference in a sibling checkpoint.

May use :mod:`jaxckpt.tree`, :mod:`jaxckpt.interop` and the layers below them; never
:mod:`jaxckpt.saving`, its sibling, nor anything above. Who hears of a load registers in
``reader.LOAD_OBSERVERS``.
"""
