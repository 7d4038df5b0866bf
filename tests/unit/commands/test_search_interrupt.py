"""Ctrl-C inside a library's clean-up: the error it raises while the KeyboardInterrupt unwinds is the Ctrl-C.

A fresh-clone ``make test`` saw Optuna's journal lock, interrupted between its rename and its clean-up, raise
``FileNotFoundError`` for its ``.rename`` file: ``autotune search`` then exited 1 with that error instead of 130
and the resume hint (``test_search_cli.py::test_ctrl_c_says_how_to_resume_and_fresh_starts_over``)."""

from __future__ import annotations

import os

import pytest

from autotune.errors import is_interrupt


def _lock_cleanup_after_ctrl_c(tmp_path) -> None:
    try:
        raise KeyboardInterrupt
    finally:
        os.remove(tmp_path / "optuna.journal.lock-gone.rename")  # what the lock's clean-up met


def test_an_error_raised_while_ctrl_c_unwinds_counts_as_the_interrupt(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        _lock_cleanup_after_ctrl_c(tmp_path)
    assert is_interrupt(caught.value) and is_interrupt(KeyboardInterrupt())


def test_an_error_of_its_own_is_not_an_interrupt(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        os.remove(tmp_path / "missing")
    assert not is_interrupt(caught.value)
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise RuntimeError("second") from None
    except RuntimeError as e:
        assert not is_interrupt(e)
