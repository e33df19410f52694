"""Other libraries' checkpoints, read-only (and safetensors also written by ``convert``): TensorFlow,
Orbax, Flax msgpack, safetensors; which format a folder holds, and each one's entries as jaxckpt's
records.

May use the layers below it (:mod:`jaxckpt.arrays` down); never :mod:`jaxckpt.tree`, its sibling.
"""
