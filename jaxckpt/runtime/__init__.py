"""Running beside the training loop: several processes on ``jax.distributed`` (a token per save,
barriers, an agreed outcome) and background work (one save in flight per owner).

May use: :mod:`jaxckpt.storage`, :mod:`jaxckpt.format`, and the shared modules.
"""
