"""A deterministic synthetic English-like corpus that a tiny masked language model visibly learns.

Each example is a short paragraph of 2-4 sentences about one *topic* (the farm, the sea, the city, …).
Sentences come from a small probabilistic grammar with the regularities a masked-LM can pick up within
minutes on a CPU:

* **agreement**: a singular subject takes ``feeds``, a plural one ``feed``; ``yesterday`` takes the past
  tense, ``tomorrow`` takes ``will`` + the base form; ``a``/``this``/``every`` go with singular nouns,
  ``these``/``many``/``two`` with plural ones; ``an`` comes before a vowel;
* **topic consistency**: nouns, verbs, places and adjectives are drawn from the paragraph's topic (with a
  little noise from the other topics), so a masked word can be guessed from the rest of the paragraph;
* **function words** in fixed positions (``the``, prepositions before places, ``,`` before ``but``);
* **Zipf's law**: in every list of choices the k-th item has a weight of 1/k, as words do in real text.

Everything is pure Python and depends only on the seed: ``random.Random(int)`` is the same Mersenne
Twister everywhere, and only its ``random()`` is used. Text is lower case apart from the first letter
of a sentence; :func:`split_words` turns text back into words, each of which is in :data:`VOCABULARY`.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["SHARD_PATTERN", "VOCABULARY", "generate_examples", "shard_name", "split_words", "write_shards"]

MIN_WORDS, MAX_WORDS = 6, 20  # per sentence, punctuation not counted
TOPIC_LOYALTY = 0.9  # probability that a content word comes from the paragraph's topic
SHARD_PATTERN = re.compile(r"^shard-\d{5}\.jsonl$")  # names of the shards write_shards makes

# Nouns are "singular/plural", verbs "base/third-person-singular/past".
_TOPICS: dict[str, dict[str, str]] = {
    "farm": {
        "agents": "farmer/farmers horse/horses cow/cows goat/goats dog/dogs shepherd/shepherds "
        "hen/hens pig/pigs",
        "things": "apple/apples fence/fences bucket/buckets tractor/tractors egg/eggs seed/seeds "
        "field/fields hay/hay carrot/carrots plow/plows",
        "places": "barn meadow orchard stable pasture",
        "verbs": "feed/feeds/fed plant/plants/planted carry/carries/carried pull/pulls/pulled "
        "gather/gathers/gathered harvest/harvests/harvested mend/mends/mended chase/chases/chased",
        "intransitive": "graze/grazes/grazed rest/rests/rested wander/wanders/wandered",
        "adjectives": "muddy green brown ripe hungry sleepy",
    },
    "sea": {
        "agents": "sailor/sailors fisherman/fishermen captain/captains gull/gulls dolphin/dolphins "
        "crab/crabs diver/divers whale/whales",
        "things": "net/nets boat/boats rope/ropes shell/shells anchor/anchors sail/sails wave/waves "
        "fish/fish map/maps oar/oars",
        "places": "harbor beach reef lighthouse island",
        "verbs": "row/rows/rowed catch/catches/caught tie/ties/tied steer/steers/steered "
        "spot/spots/spotted haul/hauls/hauled drop/drops/dropped follow/follows/followed",
        "intransitive": "swim/swims/swam drift/drifts/drifted dive/dives/dove",
        "adjectives": "salty blue wet stormy calm deep",
    },
    "city": {
        "agents": "driver/drivers clerk/clerks officer/officers tourist/tourists baker/bakers "
        "mayor/mayors cyclist/cyclists vendor/vendors",
        "things": "bus/buses ticket/tickets car/cars bridge/bridges newspaper/newspapers "
        "umbrella/umbrellas taxi/taxis sign/signs coffee/coffee phone/phones",
        "places": "station square market office street",
        "verbs": "park/parks/parked sell/sells/sold buy/buys/bought read/reads/read "
        "paint/paints/painted repair/repairs/repaired wash/washes/washed visit/visits/visited",
        "intransitive": "hurry/hurries/hurried shout/shouts/shouted commute/commutes/commuted",
        "adjectives": "busy noisy crowded tall modern grey",
    },
    "forest": {
        "agents": "hunter/hunters fox/foxes owl/owls deer/deer ranger/rangers wolf/wolves "
        "squirrel/squirrels bear/bears",
        "things": "acorn/acorns branch/branches mushroom/mushrooms log/logs nest/nests berry/berries "
        "leaf/leaves trail/trails stone/stones axe/axes",
        "places": "clearing valley cave hill creek",
        "verbs": "climb/climbs/climbed hide/hides/hid cut/cuts/cut track/tracks/tracked "
        "bury/buries/buried sniff/sniffs/sniffed stack/stacks/stacked guard/guards/guarded",
        "intransitive": "howl/howls/howled sleep/sleeps/slept hunt/hunts/hunted",
        "adjectives": "dark wild quiet ancient shady mossy",
    },
    "kitchen": {
        "agents": "cook/cooks chef/chefs waiter/waiters grandmother/grandmothers child/children "
        "cat/cats guest/guests butler/butlers",
        "things": "pot/pots soup/soups knife/knives onion/onions plate/plates bread/breads "
        "cake/cakes spoon/spoons kettle/kettles oven/ovens",
        "places": "pantry kitchen cellar restaurant bakery",
        "verbs": "bake/bakes/baked stir/stirs/stirred slice/slices/sliced boil/boils/boiled "
        "taste/tastes/tasted serve/serves/served clean/cleans/cleaned peel/peels/peeled",
        "intransitive": "eat/eats/ate hum/hums/hummed wait/waits/waited",
        "adjectives": "hot sweet spicy fresh warm sticky",
    },
    "school": {
        "agents": "teacher/teachers student/students pupil/pupils principal/principals "
        "librarian/librarians tutor/tutors janitor/janitors coach/coaches",
        "things": "book/books pencil/pencils lesson/lessons desk/desks chalk/chalk exam/exams "
        "notebook/notebooks poem/poems ruler/rulers globe/globes",
        "places": "classroom library gym hallway playground",
        "verbs": "write/writes/wrote study/studies/studied borrow/borrows/borrowed grade/grades/graded "
        "explain/explains/explained open/opens/opened copy/copies/copied check/checks/checked",
        "intransitive": "learn/learns/learned listen/listens/listened laugh/laughs/laughed",
        "adjectives": "clever curious strict patient new dusty",
    },
    "space": {
        "agents": "astronaut/astronauts pilot/pilots robot/robots engineer/engineers alien/aliens "
        "scientist/scientists commander/commanders rover/rovers",
        "things": "rocket/rockets planet/planets star/stars helmet/helmets satellite/satellites "
        "signal/signals comet/comets engine/engines orbit/orbits panel/panels",
        "places": "station crater launchpad moon observatory",
        "verbs": "launch/launches/launched measure/measures/measured fix/fixes/fixed scan/scans/scanned "
        "orbit/orbits/orbited observe/observes/observed load/loads/loaded send/sends/sent",
        "intransitive": "float/floats/floated glow/glows/glowed spin/spins/spun",
        "adjectives": "distant bright silent frozen shiny huge",
    },
    "music": {
        "agents": "singer/singers drummer/drummers pianist/pianists violinist/violinists "
        "composer/composers fan/fans conductor/conductors band/bands",
        "things": "song/songs drum/drums piano/pianos guitar/guitars melody/melodies ticket/tickets "
        "violin/violins record/records chord/chords speaker/speakers",
        "places": "concert studio theater stage festival",
        "verbs": "play/plays/played tune/tunes/tuned record/records/recorded practice/practices/practiced "
        "compose/composes/composed hear/hears/heard rehearse/rehearses/rehearsed praise/praises/praised",
        "intransitive": "dance/dances/danced sing/sings/sang clap/claps/clapped",
        "adjectives": "loud soft lively famous gentle catchy",
    },
}

_SINGULAR_DETERMINERS = ("the", "a", "this", "that", "every", "one", "my", "our")
_PLURAL_DETERMINERS = ("the", "these", "those", "some", "many", "two", "three", "my", "our", "few")
_FREQUENCY = ("often", "never", "always", "sometimes", "rarely", "usually")
_MANNER = ("quickly", "slowly", "carefully", "quietly", "gladly", "happily")
_PREPOSITIONS = ("in", "near", "behind", "beside", "at", "outside")
_FUNCTION_WORDS = (
    "an",
    "will",
    "yesterday",
    "tomorrow",
    "today",
    "and",
    "but",
    "because",
    "while",
    "he",
    "she",
    "they",
    "it",
    "very",
    ".",
    ",",
)
_VOWELS = frozenset("aeiou")
_WORD = re.compile(r"[a-z]+|[.,]")
X = TypeVar("X")


@functools.lru_cache(maxsize=64)
def _zipf(n: int) -> tuple[float, ...]:
    """Upper bounds of the first n - 1 items' shares of [0, 1) under Zipf's law (weights 1/k)."""
    weights = [1.0 / k for k in range(1, n + 1)]
    total, bounds, running = sum(weights), [], 0.0
    for weight in weights[:-1]:
        running += weight
        bounds.append(running / total)
    return tuple(bounds)


@dataclass(frozen=True)
class _Noun:
    singular: str
    plural: str


@dataclass(frozen=True)
class _Verb:
    base: str
    third: str
    past: str


@dataclass(frozen=True)
class _Topic:
    agents: tuple[_Noun, ...]
    things: tuple[_Noun, ...]
    places: tuple[str, ...]
    verbs: tuple[_Verb, ...]
    intransitive: tuple[_Verb, ...]
    adjectives: tuple[str, ...]


def _nouns(text: str) -> tuple[_Noun, ...]:
    return tuple(_Noun(*item.split("/")) for item in text.split())


def _verbs(text: str) -> tuple[_Verb, ...]:
    return tuple(_Verb(*item.split("/")) for item in text.split())


TOPICS: tuple[_Topic, ...] = tuple(
    _Topic(
        agents=_nouns(t["agents"]),
        things=_nouns(t["things"]),
        places=tuple(t["places"].split()),
        verbs=_verbs(t["verbs"]),
        intransitive=_verbs(t["intransitive"]),
        adjectives=tuple(t["adjectives"].split()),
    )
    for t in _TOPICS.values()
)


def _vocabulary() -> tuple[str, ...]:
    words: list[str] = [
        *_SINGULAR_DETERMINERS,
        *_PLURAL_DETERMINERS,
        *_FREQUENCY,
        *_MANNER,
        *_PREPOSITIONS,
        *_FUNCTION_WORDS,
    ]
    for topic in TOPICS:
        for noun in (*topic.agents, *topic.things):
            words += [noun.singular, noun.plural]
        words += topic.places
        for verb in (*topic.verbs, *topic.intransitive):
            words += [verb.base, verb.third, verb.past]
        words += topic.adjectives
    return tuple(dict.fromkeys(words))  # first occurrence wins: a stable order


#: Every word :func:`generate_examples` can emit (after :func:`split_words`), in a stable order.
VOCABULARY: tuple[str, ...] = _vocabulary()


def split_words(text: str) -> list[str]:
    """The words of ``text``, lower-cased, with ``.`` and ``,`` as words of their own."""
    return _WORD.findall(text.lower())


class _Writer:
    """One paragraph's worth of choices, all drawn from ``rng.random()``."""

    def __init__(self, rng: random.Random) -> None:
        self.random = rng.random
        self.topic = TOPICS[0]

    def pick(self, items: Sequence[X]) -> X:
        """An item with Zipf's law: the k-th (from 1) is chosen with a weight of 1/k, as in real text."""
        return items[bisect.bisect_right(_zipf(len(items)), self.random())]

    def chance(self, p: float) -> bool:
        return self.random() < p

    def topic_of_word(self) -> _Topic:
        if self.random() < TOPIC_LOYALTY:
            return self.topic
        return TOPICS[int(self.random() * len(TOPICS))]

    def noun_phrase(self, kind: str, plural: bool) -> list[str]:
        topic = self.topic_of_word()
        nouns: tuple[_Noun, ...] = topic.agents if kind == "agents" else topic.things
        noun = self.pick(nouns)
        words = [self.pick(_PLURAL_DETERMINERS if plural else _SINGULAR_DETERMINERS)]
        if self.chance(0.45):
            if self.chance(0.15):
                words.append("very")
            words.append(self.pick(self.topic_of_word().adjectives))
        words.append(noun.plural if plural else noun.singular)
        if words[0] == "a" and words[1][0] in _VOWELS:
            words[0] = "an"
        return words

    def clause(self, tense: str) -> list[str]:
        """subject, optional frequency adverb, verb (agreeing), object, place and manner."""
        plural = self.chance(0.4)
        if self.chance(0.12):
            subject = ["they"] if plural else [self.pick(("he", "she", "it"))]
        else:
            subject = self.noun_phrase("agents", plural)
        words = list(subject)
        topic = self.topic_of_word()
        transitive = self.chance(0.75)
        verbs = topic.verbs if transitive else topic.intransitive
        verb = self.pick(verbs)
        if tense == "past":
            words.append(verb.past)
        elif tense == "future":
            words += ["will", verb.base]
        else:
            if self.chance(0.3):
                words.append(self.pick(_FREQUENCY))
            words.append(verb.base if plural else verb.third)
        if transitive:
            words += self.noun_phrase("things", self.chance(0.4))
        if self.chance(0.4):
            words += [self.pick(_PREPOSITIONS), "the", self.pick(self.topic_of_word().places)]
        if self.chance(0.2):
            words.append(self.pick(_MANNER))
        return words

    def sentence(self) -> list[str]:
        roll = self.random()
        tense, words = "present", []
        if roll < 0.15:
            tense, words = "past", ["yesterday"]
        elif roll < 0.25:
            tense, words = "future", ["tomorrow"]
        elif roll < 0.3:
            words = ["today"]
        words += self.clause(tense)
        if self.chance(0.3):
            joiner = self.pick(("and", "but", "because", "while"))
            words += [",", joiner] if joiner == "but" else [joiner]
            words += self.clause(tense)
        return words

    def paragraph(self) -> str:
        self.topic = TOPICS[int(self.random() * len(TOPICS))]
        sentences = []
        for _ in range(2 + int(self.random() * 3)):
            words = self.sentence()
            while not MIN_WORDS <= sum(w not in ".," for w in words) <= MAX_WORDS:
                words = self.sentence()
            text = " ".join(words).replace(" ,", ",")
            sentences.append(text[0].upper() + text[1:] + ".")
        return " ".join(sentences)


def generate_examples(seed: int, count: int) -> Iterator[str]:
    """The first ``count`` paragraphs of the corpus stream of ``seed`` (a prefix of a longer stream).

    The same ``(seed, count)`` gives the same text in every process, on every platform.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    writer = _Writer(random.Random(seed))
    for _ in range(count):
        yield writer.paragraph()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def _shard_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"dedloc-corpus:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def write_shards(directory: Path, shards: int, examples_per_shard: int, seed: int = 0) -> list[Path]:
    """Write ``shards`` JSON-lines files ``shard-00000.jsonl`` … of ``{"text": ...}`` objects.

    Each shard is written to a hidden temporary file and renamed into place, so a shard that exists is
    complete; existing shards are kept as they are (the call is idempotent). Shard ``i`` holds the
    stream of its own seed (derived from ``seed`` and ``i``), so any subset can be regenerated alone.

    Returns:
        The paths of all ``shards`` shards, in order.
    """
    if shards < 0 or examples_per_shard < 1:
        raise ValueError(f"need shards >= 0 and examples_per_shard >= 1, got {shards}, {examples_per_shard}")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(shards):
        path = directory / shard_name(index)
        paths.append(path)
        if path.exists():
            continue
        lines = (
            json.dumps({"text": text}) + "\n"
            for text in generate_examples(_shard_seed(seed, index), examples_per_shard)
        )
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        try:
            with tmp.open("w", encoding="utf-8") as file:
                file.writelines(lines)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return paths
