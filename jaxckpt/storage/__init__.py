"""Storage: where checkpoints live and how bytes move there. A path becomes a ``Location`` (a local
folder or a prefix in a TensorStore kvstore: ``s3://``, ``gs://``, ``memory://``); small files,
listings, fsync, deadlines and retries on buckets; local folders walked and removed without
following symlinks; a manager directory's state file and its lock.

May use: :mod:`jaxckpt.format` (the name of the index), and the shared modules.
"""
