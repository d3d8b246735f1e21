"""The toy world's language: how facts are written in documents and questions, and read back.

The generator writes with these templates and the scripted expert reads with the matching
regular expressions, so the two cannot drift apart. Every fact sentence names the entity and,
for a person, the profession: two people may share a name (near-duplicate distractors), but a
(name, profession) pair is unique, and so is every document title.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- vocabulary ----------------------------------------------------------------------------------
# Syllables for fictional names: no real person, place or thing is meant.
NAME_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "kl",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "qu",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "w",
    "z",
    "th",
    "sh",
    "ch",
]
NAME_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia"]
NAME_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "st", "x")
PROFESSIONS = [
    "engineer",
    "chemist",
    "painter",
    "botanist",
    "cartographer",
    "astronomer",
    "composer",
    "sculptor",
    "physician",
    "linguist",
    "architect",
    "geologist",
    "mathematician",
    "historian",
    "weaver",
    "clockmaker",
    "navigator",
    "poet",
]
ARTIFACT_KINDS = [
    "engine",
    "loom",
    "telescope",
    "compass",
    "lantern",
    "press",
    "organ",
    "clock",
    "pump",
    "kiln",
    "sextant",
    "prism",
    "dynamo",
    "barometer",
    "lathe",
    "harp",
]
INSTITUTION_KINDS = [
    "Institute",
    "Academy",
    "College",
    "Observatory",
    "Conservatory",
    "Seminary",
    "Polytechnic",
    "Library",
]
INSTITUTION_FIELDS = (
    "Cartography",
    "Letters",
    "Mechanics",
    "Natural Philosophy",
    "Music",
    "Medicine",
    "Navigation",
    "Botany",
    "Astronomy",
    "Architecture",
    "Mathematics",
    "Fine Arts",
    "Chemistry",
    "Languages",
)
PROVINCE_SUFFIXES = ("shire", "mark", "land", "vale", "reach", "march")
FILLER_NOUNS = [
    "archive",
    "river",
    "harbor",
    "festival",
    "bridge",
    "market",
    "orchard",
    "manuscript",
    "garden",
    "workshop",
    "tower",
    "canal",
    "ledger",
    "mill",
    "expedition",
    "guild",
    "council",
    "lecture",
    "season",
    "quarry",
    "chapel",
    "fountain",
]
FILLER_ADJECTIVES = [
    "old",
    "quiet",
    "northern",
    "crowded",
    "narrow",
    "famous",
    "forgotten",
    "celebrated",
    "modest",
    "distant",
    "ornate",
    "weathered",
    "bustling",
    "remote",
    "renowned",
    "humble",
]
FILLER_VERBS = [
    "described",
    "praised",
    "recorded",
    "revisited",
    "mapped",
    "restored",
    "debated",
    "catalogued",
]

# --- document templates --------------------------------------------------------------------------
# {a} is the indefinite article for the profession that follows.
PERSON_FACTS = (
    "{name} is {a} {profession} born in {city} in {year}.",
    "{name} studied at the {institution}.",
)
PERSON_MENTOR = "{name} was mentored by the {mentor_profession} {mentor}."
ARTIFACT_FACTS = (
    "The {artifact} is {a} {kind} first demonstrated in {year}.",
    "The {artifact} was invented by the {inventor_profession} {inventor}.",
)
INSTITUTION_FACTS = (
    "The {institution} was founded in {year} in the city of {city}.",
    "Its first director was the {director_profession} {director}.",
)
CITY_FACTS = ("{city} is a city in the province of {province}.", "It has a population of {population}.")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def person_title(name: str, profession: str) -> str:
    return f"{name} ({profession})"


def front_matter(title: str, body: str) -> str:
    """BrowseComp-Plus documents carry their title in a ``---\\ntitle: …\\n---`` front matter."""
    return f"---\ntitle: {title}\n---\n\n{body}"


def url_for(title: str) -> str:
    return "https://toyworld.example/wiki/" + title.replace(" ", "_")


# --- reading documents back ----------------------------------------------------------------------
_TITLE_RE = re.compile(r"^---\s*title:\s*(.*?)\s*---")
_NAME = r"[A-Z][A-Za-z\-]*(?: [A-Z][A-Za-z\-]*)*"
_PROF = r"[a-z]+"


def normalize(text: str) -> str:
    return " ".join(text.split())


def doc_title(text: str) -> str | None:
    """The title of a document, from its full text or a whitespace-collapsed snippet of it."""
    m = _TITLE_RE.match(normalize(text))
    return m.group(1) if m else None


@dataclass(frozen=True)
class Ref:
    """A pointer to another document, by its title (what the expert searches for next)."""

    title: str
    label: str  # how the answer names it (a person's name without the profession)


def _ref_person(profession: str, name: str) -> Ref:
    return Ref(title=person_title(name, profession), label=name)


def read_relation(title: str, text: str, relation: str) -> Ref | None:
    """Read one relation of the entity titled ``title`` out of its document ``text``.

    Relations: ``birth_city``, ``birth_year``, ``institution``, ``mentor`` (persons);
    ``inventor``, ``year`` (artifacts); ``founded``, ``director``, ``city`` (institutions);
    ``province`` (cities). Values that are not documents (years, provinces) come back as a Ref
    whose title is the value itself.
    """
    text = normalize(text)
    name = title.rsplit(" (", 1)[0]
    n = re.escape(name)
    t = re.escape(title)
    patterns = {
        "birth_city": (rf"{n} is an? {_PROF} born in ({_NAME}) in \d{{4}}\.", None),
        "birth_year": (rf"{n} is an? {_PROF} born in {_NAME} in (\d{{4}})\.", None),
        "institution": (rf"{n} studied at the ({_NAME}(?: of {_NAME})?)\.", None),
        "mentor": (rf"{n} was mentored by the ({_PROF}) ({_NAME})\.", "person"),
        "inventor": (rf"The {t} was invented by the ({_PROF}) ({_NAME})\.", "person"),
        "year": (rf"The {t} is an? {_PROF} first demonstrated in (\d{{4}})\.", None),
        "founded": (rf"The {t} was founded in (\d{{4}}) in the city of {_NAME}\.", None),
        "city": (rf"The {t} was founded in \d{{4}} in the city of ({_NAME})\.", None),
        "director": (rf"Its first director was the ({_PROF}) ({_NAME})\.", "person"),
        "province": (rf"{t} is a city in the province of ({_NAME})\.", None),
    }
    if relation not in patterns:
        raise ValueError(f"unknown relation {relation!r}")
    pattern, kind = patterns[relation]
    m = re.search(pattern, text)
    if not m:
        return None
    if kind == "person":
        return _ref_person(m.group(1), m.group(2))
    return Ref(title=m.group(1), label=m.group(1))


# --- questions -----------------------------------------------------------------------------------
# Each template: tier, the wording, the start entity kind, and the relation chain the answer
# follows (one document per step). Easy: 1 document; medium: 2; hard: 3 (three hops).
@dataclass(frozen=True)
class QuestionTemplate:
    key: str
    tier: str
    text: str
    start: str  # person | artifact | institution
    chain: tuple[str, ...]


QUESTION_TEMPLATES = (
    QuestionTemplate(
        "e_founded", "easy", "In what year was the {institution} founded?", "institution", ("founded",)
    ),
    QuestionTemplate(
        "e_birth_city", "easy", "In which city was the {profession} {person} born?", "person", ("birth_city",)
    ),
    QuestionTemplate(
        "e_demo_year", "easy", "In what year was the {artifact} first demonstrated?", "artifact", ("year",)
    ),
    QuestionTemplate(
        "m_inst_founded",
        "medium",
        "In what year was the institution where the {profession} {person} studied founded?",
        "person",
        ("institution", "founded"),
    ),
    QuestionTemplate(
        "m_inventor_city",
        "medium",
        "In which city was the inventor of the {artifact} born?",
        "artifact",
        ("inventor", "birth_city"),
    ),
    QuestionTemplate(
        "m_inst_director",
        "medium",
        "Who was the first director of the institution where the {profession} {person} studied?",
        "person",
        ("institution", "director"),
    ),
    QuestionTemplate(
        "h_mentor_inst_founded",
        "hard",
        "In what year was the institution founded where the mentor of the {profession} {person} studied?",
        "person",
        ("mentor", "institution", "founded"),
    ),
    QuestionTemplate(
        "h_inventor_mentor_city",
        "hard",
        "In which city was the mentor of the inventor of the {artifact} born?",
        "artifact",
        ("inventor", "mentor", "birth_city"),
    ),
    QuestionTemplate(
        "h_inventor_city_province",
        "hard",
        "In which province lies the city where the inventor of the {artifact} was born?",
        "artifact",
        ("inventor", "birth_city", "province"),
    ),
)
TEMPLATES_BY_KEY = {t.key: t for t in QUESTION_TEMPLATES}


def _template_regex(template: QuestionTemplate) -> re.Pattern[str]:
    slots = {
        "{institution}": rf"(?P<institution>{_NAME}(?: of {_NAME})?)",
        "{profession}": rf"(?P<profession>{_PROF})",
        "{person}": rf"(?P<person>{_NAME})",
        "{artifact}": rf"(?P<artifact>{_NAME} {_PROF})",
    }
    pattern = re.escape(template.text)
    for slot, group in slots.items():
        pattern = pattern.replace(re.escape(slot), group)
    return re.compile(pattern)


_TEMPLATE_RES = [(t, _template_regex(t)) for t in QUESTION_TEMPLATES]


@dataclass(frozen=True)
class ParsedQuestion:
    template: QuestionTemplate
    start_title: str


def parse_question(text: str) -> ParsedQuestion | None:
    """Recognise a toy-world question anywhere in ``text`` (e.g. inside a delegated task)."""
    if not isinstance(text, str):
        return None
    text = normalize(text)
    for template, regex in _TEMPLATE_RES:
        m = regex.search(text)
        if not m:
            continue
        g = m.groupdict()
        if template.start == "person":
            start = person_title(g["person"], g["profession"])
        elif template.start == "artifact":
            start = g["artifact"]
        else:
            start = g["institution"]
        return ParsedQuestion(template, start)
    return None
