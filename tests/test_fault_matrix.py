"""The fault matrix of docs/reliability.md is the one the tests' `fault` markers declare (tests/faultmatrix.py)."""

from __future__ import annotations

import faultmatrix
import pytest
from conftest import ROOT


def test_the_docs_matrix_is_the_one_the_tests_declare():
    assert faultmatrix.in_docs(ROOT / "docs/reliability.md") == faultmatrix.table(faultmatrix.declared())


def test_a_marker_outside_the_matrix_is_refused():
    with pytest.raises(ValueError, match="the phases are"):
        faultmatrix.check("reading tea leaves", "SIGKILL")
