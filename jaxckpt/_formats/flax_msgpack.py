"""Placeholder: the flax_msgpack reader is being written (issue 13)."""

from __future__ import annotations

NAME = "flax_msgpack"


def detect(path: str) -> bool:
    return False


def manages(directory: str) -> bool:
    return False


def latest(directory: str) -> str | None:
    return None


def open(path: str):  # noqa: A001
    raise NotImplementedError
