"""Training text: a user's file through `datasets`, or a synthetic corpus built offline.

The synthetic corpus exists so that every recipe runs out of the box with no download. It is English-like
text with real structure to learn — templated sentences over fixed word lists, grammatical agreement, and
documents that keep talking about the same characters and places — so the loss falls well below the
unigram entropy within a few dozen steps, which a random-token corpus would never show.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

logger = logging.getLogger(__name__)

_NAMES = ["Ada", "Basil", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko",
    "Liam", "Mira", "Nils", "Olga", "Pavel", "Rosa", "Tariq"]  # fmt: skip
_NOUNS = ["river", "garden", "engine", "letter", "window", "market", "forest", "bridge", "lantern",
    "harbor", "valley", "kitchen", "library", "tower", "village", "machine", "orchard", "meadow", "castle",
    "station", "teacher", "farmer", "sailor", "doctor", "painter", "baker"]  # fmt: skip
_PLACES = ["north", "coast", "old", "town", "hills", "island", "station", "square", "mill", "lighthouse",
    "quarry", "monastery"]  # fmt: skip
_ADJECTIVES = ["quiet", "bright", "old", "narrow", "heavy", "gentle", "broken", "golden", "distant",
    "careful", "warm", "cold", "hidden", "busy"]  # fmt: skip
_ADVERBS = ["slowly", "quickly", "carefully", "quietly", "suddenly", "happily", "rarely", "often",
    "gladly"]  # fmt: skip
# (present third person, past) so that sentences agree with their tense.
_VERBS = [
    ("finds", "found"),
    ("repairs", "repaired"),
    ("paints", "painted"),
    ("visits", "visited"),
    ("watches", "watched"),
    ("builds", "built"),
    ("opens", "opened"),
    ("carries", "carried"),
    ("remembers", "remembered"),
    ("follows", "followed"),
    ("describes", "described"),
    ("cleans", "cleaned"),
]
_NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]  # fmt: skip

_TEMPLATES = (
    "{name} {past} the {adj} {noun} near the {place}.",
    "Every morning {name} {present} the {noun} {adverb}.",
    "The {noun} was {adj}, so {name} {past} it {adverb}.",
    "In the {place} there were {number} {noun}s and one {adj} {noun2}.",
    "{name} said that the {noun} in the {place} was {adj}.",
    "When {name} {past} the {noun}, {name2} {past2} the {noun2}.",
    "{name} and {name2} walked to the {place} to see the {adj} {noun}.",
    "Nobody {past} the {noun2} because it was too {adj}.",
    "After {number} days, {name} {adverb} {past} the {adj} {noun}.",
    "The {adj} {noun} of the {place} is where {name} {present} the {noun2}.",
)


def _sentence(rng: random.Random, cast: list[str], places: list[str]) -> str:
    present, past = rng.choice(_VERBS)
    present2, past2 = rng.choice(_VERBS)
    noun, noun2 = rng.sample(_NOUNS, 2)
    name, name2 = rng.sample(cast, 2)
    return rng.choice(_TEMPLATES).format(
        name=name,
        name2=name2,
        noun=noun,
        noun2=noun2,
        place=rng.choice(places),
        adj=rng.choice(_ADJECTIVES),
        adverb=rng.choice(_ADVERBS),
        number=rng.choice(_NUMBERS),
        present=present,
        past=past,
        past2=past2,
        present2=present2,
    )


def synthetic_corpus(
    num_documents: int = 2000, seed: int = 0, sentences: tuple[int, int] = (4, 10)
) -> list[str]:
    """Deterministic documents (one string each) of a few sentences about a small cast and a few places."""
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        cast = rng.sample(_NAMES, 3)
        places = rng.sample(_PLACES, 2)
        n = rng.randint(*sentences)
        documents.append(" ".join(_sentence(rng, cast, places) for _ in range(n)))
    return documents


def load_text_file(
    path: str | Path, text_column: str = "text", cache_dir: str | Path | None = None
) -> list[str]:
    """Documents of a .txt file (one per non-empty line) or a .json/.jsonl file (``text_column`` of each row),
    read with `datasets` so that large files are memory-mapped rather than held twice."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--train_file/--eval_file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        builder = "json"
    elif suffix in (".txt", ".text", ""):
        builder = "text"
    else:
        raise ValueError(
            f"cannot read {str(path)!r}: expected a .txt file (one document per line) or .json/.jsonl "
            f"(one object per line with a {text_column!r} field)"
        )
    dataset = datasets.load_dataset(
        builder, data_files=str(path), split="train", cache_dir=str(cache_dir) if cache_dir else None
    )
    if text_column not in dataset.column_names:
        raise ValueError(
            f"{str(path)!r} has no column {text_column!r} (columns: {dataset.column_names}); "
            "pass --text_column with the name of the text field"
        )
    documents = [t for t in dataset[text_column] if isinstance(t, str) and t.strip()]
    if not documents:
        raise ValueError(f"{str(path)!r} contains no non-empty text in column {text_column!r}")
    logger.info("read %d documents from %s", len(documents), path)
    return documents


def split_documents(documents: list[str], eval_percentage: float) -> tuple[list[str], list[str]]:
    """Hold out the last ``eval_percentage`` % of documents (at least one) for evaluation; the split is a
    fixed cut, so every process and every resumed run sees the same two sets."""
    if not 0 <= eval_percentage < 100:
        raise ValueError(f"--validation_split_percentage must be in [0, 100), got {eval_percentage}")
    if eval_percentage == 0 or len(documents) < 2:
        return documents, []
    n_eval = max(1, int(len(documents) * eval_percentage / 100))
    return documents[:-n_eval], documents[-n_eval:]
