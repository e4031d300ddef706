"""Validation bugs the bad-input suites found, pinned where they were fixed: a path
from a request that no filesystem can hold (a 300-character name: ENAMETOOLONG) raised
a bare OSError, which gRPC answered UNKNOWN ("Unexpected <class 'OSError'>")."""

from __future__ import annotations

import pytest

from cascade.index import RetrievalIndex
from ranker.serving import open_export
from recserve.errors import InvalidArgument

TOO_LONG = "a" * 300  # one path component over NAME_MAX (255)


def test_a_models_dir_too_long_for_any_filesystem_is_invalid_argument_naming_it() -> None:
    with pytest.raises(InvalidArgument, match=r"^models_dir 'a{80}'\.\.\. \(300 characters\) is not a usable path: File name too long"):
        open_export(TOO_LONG)


def test_an_index_path_too_long_for_any_filesystem_is_invalid_argument_naming_it() -> None:
    with pytest.raises(InvalidArgument, match=r"^index_path 'a{80}'\.\.\. \(300 characters\) is not a usable path"):
        RetrievalIndex.load(TOO_LONG)
