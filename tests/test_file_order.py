"""tests/file_order.py: the suite's files longest first, each file's tests in their order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from file_order import MEDIUM, SECONDS, longest_first


def test_files_go_longest_first_and_the_short_ones_keep_their_places() -> None:
    ids = ["tests/test_a.py::t1", "tests/test_bench.py::t1", "tests/test_a.py::t2", "tests/test_resume.py::t1",
           "tests/test_b.py::t1[x]", "tests/test_bench.py::t2", "tests/test_b.py::t1[y]", "tests/test_c.py::t1",
           "tests/test_c.py::t2"]
    # test_c's second test starts Ray: the whole file counts as MEDIUM, ahead of the short ones
    fixtures = {"tests/test_c.py::t2": ["tmp_path", "ray_cluster"]}
    items = [SimpleNamespace(nodeid=i, fixturenames=fixtures.get(i, ["tmp_path"])) for i in ids]
    longest_first(items)
    assert SECONDS["test_bench.py"] > SECONDS["test_resume.py"] > MEDIUM > 0
    assert [i.nodeid for i in items] == [
        "tests/test_bench.py::t1", "tests/test_bench.py::t2", "tests/test_resume.py::t1", "tests/test_c.py::t1",
        "tests/test_c.py::t2", "tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t1[x]",
        "tests/test_b.py::t1[y]"]


def test_every_file_in_the_table_exists() -> None:
    """A renamed or deleted file would silently fall back to the short ones' order."""
    here = Path(__file__).parent
    assert [name for name in SECONDS if not (here / name).is_file()] == []
