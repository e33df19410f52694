"""A save: the snapshot in the caller's thread, then the records, packs, writes and the publish in
the background; how it appears atomically (staging folders, markers); each process's data-iterator
states; and the seam through which a manager's memory offers what an earlier checkpoint holds
(:mod:`jaxckpt.saving.reuse`).

May use :mod:`jaxckpt.tree` and the layers below it; never :mod:`jaxckpt.reading`, its sibling, nor
anything above (the manager, incremental saves).
"""
