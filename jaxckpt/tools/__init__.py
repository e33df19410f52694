"""Tools for people: :func:`jaxckpt.inspect` and its views, the ``jaxckpt`` command (``ls``, ``tree``,
``show``, ``verify``, ``diff``, ``convert``), and how keys, types and shapes read to people.

The top layer: may use every other.
"""
