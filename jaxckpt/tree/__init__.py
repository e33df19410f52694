"""The object graph: objects become keys and leaves, and keys become objects again (pytrees, Flax NNX
modules and states, ``Checkpoint`` children), with a quick walk for the saves of a training loop.

May use the layers below it (:mod:`jaxckpt.arrays` down); never :mod:`jaxckpt.interop`, its sibling.
"""
