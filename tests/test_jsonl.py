"""rlpost.core.jsonl: the one JSON Lines reader behind task files, reward-model pairs and XRPO's exemplars."""

import pytest

from rlpost.core.errors import ConfigError, DataError
from rlpost.core.jsonl import iter_jsonl


def test_rows_and_line_numbers_count_blank_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"x": 1}\n\n   \n{"x": 2, "y": "z"}\n')
    assert list(iter_jsonl(f, DataError)) == [(1, {"x": 1}), (4, {"x": 2, "y": "z"})]
    f.write_text("")
    assert list(iter_jsonl(f, DataError)) == []


def test_errors_name_the_file_the_line_and_the_fix(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text('{"x": 1}\n{"x": \n')
    with pytest.raises(DataError, match=r"^task file .*b\.jsonl:2 is not JSON \(.*\); each line must be one JSON "
                                        r"object\. Fix: write one object a line$"):
        list(iter_jsonl(f, DataError, "task file", "Fix: write one object a line"))
    f.write_text('{"x": 1}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"^.*b\.jsonl:2 is a JSON list, expected an object\.$"):
        list(iter_jsonl(f, ConfigError))
    rows = iter_jsonl(f, DataError)
    assert next(rows) == (1, {"x": 1})  # streamed: the rows before the bad line come out first
