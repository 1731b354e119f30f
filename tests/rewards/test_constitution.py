"""Constitution files: the default one loads, YAML and plain text parse to the same principles, and bad
files fail with the file, the line and the field."""

import random

import pytest

from tether.rewards.constitution import (
    Constitution,
    ConstitutionError,
    constitution_names,
    fill,
    load_constitution,
    parse_constitution,
)

YAML = """\
name: mine
description: two rules
principles:
  - name: secret
    critique_request: Does the response reveal the secret?
    revision_request: Rewrite it without the secret.
    comparison: Which keeps the secret?
    weight: 3
  - critique_request: Is it rude?
    revision_request: Rewrite it politely.
"""

TEXT = """\
# two rules
[secret]
critique_request: Does the response
  reveal the secret?
revision_request: Rewrite it without the secret.
comparison: Which keeps the secret?
weight: 3

critique_request: Is it rude?
revision_request: Rewrite it politely.
"""


def test_the_default_constitution_ships_as_package_data():
    assert "default" in constitution_names()
    c = load_constitution()
    assert c.name == "default" and len(c) >= 5
    assert all(p.critique_request and p.revision_request and p.comparison for p in c.principles)
    assert "confidential" in [p.name for p in c.principles]


def test_yaml_and_text_give_the_same_principles(tmp_path):
    (tmp_path / "c.yaml").write_text(YAML)
    (tmp_path / "c.txt").write_text(TEXT)
    a, b = load_constitution(tmp_path / "c.yaml"), load_constitution(str(tmp_path / "c.txt"))
    assert a.name == "mine" and b.name == "c"
    assert a.principles == b.principles
    first, second = a.principles
    assert (first.name, first.weight, first.comparison_text) == ("secret", 3.0, "Which keeps the secret?")
    assert (second.name, second.weight) == ("principle-2", 1.0)
    assert second.comparison_text == "Is it rude?"  # no comparison: the critique request


def test_a_bare_yaml_list_works_and_sampling_follows_the_weights():
    c = parse_constitution("- {critique_request: a, revision_request: b, weight: 9}\n"
                           "- {critique_request: c, revision_request: d}\n")
    rng = random.Random(0)
    draws = [c.sample(rng).name for _ in range(2000)]
    assert 0.85 < draws.count("principle-1") / 2000 < 0.95


@pytest.mark.parametrize(("text", "kind", "line", "field", "words"), [
    ("principles:\n  - critique_request: a\n", "yaml", 2, "revision_request", "has no revision_request"),
    ("principles:\n  - critique_request: a\n    revision_request: b\n    critque: c\n", "yaml", 4, "critque",
     "unknown field"),
    ("principles:\n  - critique_request: a\n    revision_request: b\n    weight: -1\n", "yaml", 4, "weight",
     "positive number"),
    ("principles:\n  - critique_request: ''\n    revision_request: b\n", "yaml", 2, "critique_request",
     "non-empty text"),
    ("principles:\n  - critique_request: [a, b]\n    revision_request: b\n", "yaml", 2, "critique_request",
     "single value"),
    ("principles:\n  - {critique_request: a, revision_request: b, name: x}\n  - {critique_request: a, "
     "revision_request: b, name: x}\n", "yaml", 3, "name", "used twice"),
    ("rules:\n  - {critique_request: a, revision_request: b}\n", "yaml", 1, "rules", "unknown top-level key"),
    ("principles: a list\n", "yaml", 1, "principles", "must be a list"),
    ("principles:\n  - just text\n", "yaml", 2, None, "must be a mapping"),
    ("principles: [\n", "yaml", 2, None, "not valid YAML"),
    ("critique_request: a\n\nrevision_request: b\n", "text", 1, "revision_request", "has no revision_request"),
    ("critique_request: a\nrevision_request: b\nthis line is wrong\n", "text", 3, None, "expected 'key: value'"),
    ("critique_request: a\ncritique_request: b\n", "text", 2, "critique_request", "given twice"),
])
def test_bad_files_name_the_line_and_the_field(tmp_path, text, kind, line, field, words):
    path = tmp_path / ("bad.yaml" if kind == "yaml" else "bad.txt")
    path.write_text(text)
    with pytest.raises(ConstitutionError) as info:
        load_constitution(path)
    err = info.value
    assert (err.source, err.line, err.field) == (str(path), line, field)
    assert str(path) in str(err) and f"line {line}" in str(err) and words in str(err)


def test_empty_and_missing_files():
    with pytest.raises(ConstitutionError, match="no principles"):
        parse_constitution("# nothing\n", kind="text")
    with pytest.raises(ConstitutionError, match="empty file"):
        parse_constitution("")
    with pytest.raises(ConstitutionError, match="not a built-in constitution"):
        load_constitution("no/such/file.yaml")


def test_fill_substitutes_once():
    assert fill("{a} and {b} {c}", a="{b}", b="x") == "{b} and x {c}"
    assert isinstance(load_constitution(load_constitution()), Constitution)
