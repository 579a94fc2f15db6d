"""The synthetic corpus: deterministic, closed over its vocabulary, English-like, written as shards."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from shared.data.corpus import (
    MAX_WORDS,
    MIN_WORDS,
    TOPICS,
    VOCABULARY,
    generate_examples,
    split_words,
    write_shards,
)

ROOT = Path(__file__).resolve().parents[3]


def test_corpus_is_deterministic_within_and_across_processes() -> None:
    first = list(generate_examples(7, 50))
    assert first == list(generate_examples(7, 50))
    assert list(generate_examples(7, 10)) == first[:10]  # a prefix of the same stream
    assert list(generate_examples(8, 50)) != first
    code = "from shared.data.corpus import generate_examples; print(repr(list(generate_examples(7, 50))))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert other.stdout.strip() == repr(first)


def test_corpus_vocabulary_is_closed_stable_and_of_the_promised_size() -> None:
    assert 300 <= len(VOCABULARY) <= 800
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert VOCABULARY[:3] == ("the", "a", "this")
    seen: Counter[str] = Counter()
    for text in generate_examples(1, 3000):
        seen.update(split_words(text))
    assert set(seen) <= set(VOCABULARY), sorted(set(seen) - set(VOCABULARY))
    assert len(seen) > 0.95 * len(VOCABULARY)  # (nearly) every word is actually used


def test_corpus_sentences_are_english_like() -> None:
    for text in generate_examples(3, 300):
        sentences = text.split(". ")
        assert 2 <= len(sentences) <= 4
        assert text.endswith(".")
        for sentence in sentences:
            assert sentence[0].isupper()
            words = [w for w in split_words(sentence) if w not in ".,"]
            assert MIN_WORDS <= len(words) <= MAX_WORDS, sentence
            for before, after in itertools.pairwise(words):
                if before == "a":
                    assert after[0] not in "aeiou", sentence
                if before == "an":
                    assert after[0] in "aeiou", sentence


def test_corpus_subject_and_verb_agree() -> None:
    """``one farmer feeds``, ``two farmers feed``: the number of the subject shows on the verb."""
    nouns = {
        form for topic in TOPICS for n in (*topic.agents, *topic.things) for form in (n.singular, n.plural)
    }
    verbs = [v for topic in TOPICS for v in (*topic.verbs, *topic.intransitive)]
    third = {v.third for v in verbs} - nouns
    base = {v.base for v in verbs} - nouns - third
    forms = {form for v in verbs for form in (v.base, v.third, v.past)}  # some are nouns too: skipped
    counts = Counter[str]()
    for text in generate_examples(4, 2000):
        for sentence in text.lower().removesuffix(".").split(". "):
            words = split_words(sentence)
            if words[0] == "today":
                words = words[1:]
            first_verb = next((w for w in words if w in forms), None)
            if words[0] in ("yesterday", "tomorrow") or first_verb not in third | base:
                continue
            if words[0] in ("one", "every", "this", "that", "a", "an", "he", "she", "it"):
                counts["singular"] += 1
                assert first_verb in third, sentence
            elif words[0] in ("two", "three", "these", "those", "many", "some", "few", "they"):
                counts["plural"] += 1
                assert first_verb in base, sentence
    assert counts["singular"] > 300 and counts["plural"] > 300


def test_write_shards_writes_json_lines_atomically_and_idempotently(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "shards", shards=3, examples_per_shard=20, seed=5)
    assert [p.name for p in paths] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [p.name for p in paths]  # no temp
    rows = [json.loads(line) for line in paths[1].read_text().splitlines()]
    assert len(rows) == 20 and all(set(row) == {"text"} for row in rows)
    texts = {p.read_text() for p in paths}
    assert len(texts) == 3  # each shard its own stream

    # existing shards are kept as they are; missing ones are written the same as the first time
    paths[0].write_text('{"text": "kept"}\n')
    original = paths[2].read_text()
    paths[2].unlink()
    again = write_shards(tmp_path / "shards", shards=4, examples_per_shard=20, seed=5)
    assert again[:3] == paths and again[3].exists()
    assert paths[0].read_text() == '{"text": "kept"}\n'
    assert paths[2].read_text() == original
    other_seed = write_shards(tmp_path / "other", shards=1, examples_per_shard=20, seed=6)
    assert other_seed[0].read_text() != original


def test_write_shards_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="examples_per_shard"):
        write_shards(tmp_path, shards=1, examples_per_shard=0)
