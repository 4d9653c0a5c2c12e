"""One wording for a YAML parse error, whoever reads the file."""

from __future__ import annotations

import pytest
import yaml

from proxy.karta.yamltext import Loader, yaml_error


def parse_error(text: str) -> yaml.YAMLError:
    with pytest.raises(yaml.YAMLError) as e:
        list(yaml.load_all(text, Loader=Loader))
    return e.value


def test_position_problem_and_context_on_one_line() -> None:
    got = yaml_error(parse_error("a:\n  b: 1\n c: 2\n"))
    assert got.startswith("invalid YAML: line 3, column 2: "), got
    assert "(while parsing a block mapping at line 1, column 1)" in got, got
    assert "\n" not in got


def test_an_error_without_a_position_is_its_own_text_cut_short() -> None:
    got = yaml_error(yaml.YAMLError("first\nsecond " + "x" * 400))
    assert got.startswith("invalid YAML: first second x")
    assert len(got) == 300 and got.endswith("...")
