"""The manager: :class:`jaxckpt.CheckpointManager` with TensorFlow's and Orbax's calls, its options,
start-up (adoption, clean-up), retention and its policies, run metadata, preemption, and two tiers
with their durable copies.

May use every layer below it; only :mod:`jaxckpt.tools` is above.
"""
