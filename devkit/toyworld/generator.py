"""Generate the toy world: a fictional corpus and questions in the BrowseComp-Plus formats.

The world is a small knowledge graph — cities, institutions, people, artifacts — written out as
one encyclopedia page per entity, plus "chronicle" pages that mention entities in passing (noise
for retrieval). Questions follow relation chains through the graph:

* easy: the answer is on the page of the entity the question names (1 document);
* medium: two hops (2 documents), e.g. the inventor of an artifact, then where they were born;
* hard: three hops (3 documents), and every page on the chain has near-duplicate distractors —
  a namesake with another profession, or an artifact with the same name but another kind —
  whose pages read almost the same with different facts.

Every relation is a function, so every question has exactly one answer, found by reading the
evidence pages. The same seed gives byte-identical files (no set iteration, one seeded RNG).

Formats: ``corpus.jsonl`` rows are ``{"docid", "text", "url"}`` with the title in a
``---\\ntitle: …\\n---`` front matter (BrowseComp-Plus); ``questions.jsonl`` (test split) and
``train.jsonl`` (and, when asked for, ``dev.jsonl``: a development split per tier, page-disjoint from
test and train like test is, for every choice a test split must not make) rows carry the FoldAgent
split fields ``query_id``, ``query``, ``answer``,
``data_source`` (``bc_test_easy|bc_test_meduim|bc_test_hard`` — upstream's spelling),
``evidence_docs`` and ``gold_docs`` (``{"docid", "text", "url"}`` each, as BrowseComp-Plus).
Qrels in TREC format sit beside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from devkit.toyworld import grammar as g

GENERATOR_VERSION = "1"
TIERS = ("easy", "medium", "hard")
# Upstream data_source names (FoldAgent splits), "meduim" misspelt as upstream has it.
TEST_SOURCES = {"easy": "bc_test_easy", "medium": "bc_test_meduim", "hard": "bc_test_hard"}
TRAIN_SOURCES = {"easy": "bc_train_easy", "medium": "bc_train_meduim", "hard": "bc_train_hard"}
# The dev split (ours: FoldAgent has none), named like the others.
DEV_SOURCES = {"easy": "bc_dev_easy", "medium": "bc_dev_meduim", "hard": "bc_dev_hard"}
SOURCES = {"test": TEST_SOURCES, "dev": DEV_SOURCES, "train": TRAIN_SOURCES}

# Shares of the entity pages; chronicle pages fill the rest of the requested document count.
SHARE_CITIES = 0.04
SHARE_INSTITUTIONS = 0.08
SHARE_PEOPLE = 0.40
SHARE_ARTIFACTS = 0.25
MENTOR_RATE = 0.8
NAMESAKES_PER_HARD_PERSON = 2
NAMESAKES_PER_HARD_ARTIFACT = 2
MIN_DOCS = 300


class ToyWorldError(ValueError):
    """A request the generator cannot satisfy (e.g. too few documents for the questions)."""


@dataclass
class City:
    name: str
    province: str
    population: int


@dataclass
class Institution:
    name: str
    founded: int
    city: City
    director: Person | None = None


@dataclass
class Person:
    name: str
    profession: str
    birth_city: City
    birth_year: int
    institution: Institution
    mentor: Person | None = None

    @property
    def title(self) -> str:
        return g.person_title(self.name, self.profession)


@dataclass
class Artifact:
    name: str  # "Quillan engine"
    kind: str
    year: int
    inventor: Person


Entity = City | Institution | Person | Artifact


@dataclass
class Question:
    query_id: str
    query: str
    answer: str
    tier: str
    split: str
    template: str
    chain: list[Entity]  # the evidence pages, in the order they are read

    def data_source(self) -> str:
        return SOURCES[self.split][self.tier]


@dataclass
class World:
    seed: int
    corpus: list[dict[str, str]]
    test: list[dict]
    train: list[dict]
    docid_of: dict[str, str] = field(repr=False)  # title → docid
    dev: list[dict] = field(default_factory=list)

    def manifest(self) -> dict:
        tiers = {t: sum(1 for q in self.test if q["data_source"] == TEST_SOURCES[t]) for t in TIERS}
        train_tiers = {t: sum(1 for q in self.train if q["data_source"] == TRAIN_SOURCES[t]) for t in TIERS}
        return {
            "generator": "bcstack toyworld",
            "version": GENERATOR_VERSION,
            "seed": self.seed,
            "documents": len(self.corpus),
            "test_questions": len(self.test),
            "test_tiers": tiers,
            "train_questions": len(self.train),
            "train_tiers": train_tiers,
            **(
                {
                    "dev_questions": len(self.dev),
                    "dev_tiers": {
                        t: sum(1 for q in self.dev if q["data_source"] == DEV_SOURCES[t]) for t in TIERS
                    },
                }
                if self.dev
                else {}
            ),
        }


class _Names:
    """Unique fictional names drawn from syllables."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        r = self.rng
        parts = [r.choice(g.NAME_ONSETS) + r.choice(g.NAME_VOWELS) for _ in range(syllables)]
        return ("".join(parts) + r.choice(g.NAME_CODAS)).capitalize()

    def unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise ToyWorldError("ran out of fictional names; use fewer documents")


class _Builder:
    def __init__(
        self,
        n_docs: int,
        seed: int,
        per_tier: int,
        train_medium: int,
        train_hard: int,
        train_easy: int = 0,
        dev_per_tier: int = 0,
    ) -> None:
        n_questions = 3 * (per_tier + dev_per_tier) + train_easy + train_medium + train_hard
        # Room for the near-duplicates of every hard chain (at most two per page, three pages).
        hard = per_tier + dev_per_tier + train_hard
        reserve = hard * 3 * max(NAMESAKES_PER_HARD_PERSON, NAMESAKES_PER_HARD_ARTIFACT)
        needed = max(MIN_DOCS, reserve + MIN_DOCS + 2 * n_questions)
        if n_docs < needed:
            raise ToyWorldError(
                f"--docs must be at least {needed:,} for {n_questions} questions (got {n_docs:,}); "
                "use more --docs or fewer questions"
            )
        self.base_docs = n_docs - reserve
        self.rng = random.Random(seed)
        self.n_docs = n_docs
        self.seed = seed
        self.per_tier = per_tier
        self.dev_per_tier = dev_per_tier
        self.train_easy = train_easy
        self.train_medium = train_medium
        self.train_hard = train_hard
        self.names = _Names(self.rng)
        self.year0 = 1700

    # -- entities ----------------------------------------------------------------------------
    def person_name(self) -> str:
        first = self.names.word(self.rng.choice((1, 2)))
        return self.names.unique(lambda: f"{first} {self.names.word(self.rng.choice((2, 3)))}")

    def build_graph(self) -> None:
        r, n = self.rng, self.base_docs
        self.cities = []
        for _ in range(max(8, int(n * SHARE_CITIES))):
            name = self.names.unique(lambda: self.names.word(r.choice((2, 3))))
            province = self.names.word(2) + r.choice(g.PROVINCE_SUFFIXES)
            self.cities.append(City(name, province.capitalize(), r.randrange(2_000, 900_000)))
        self.institutions = []
        for _ in range(max(8, int(n * SHARE_INSTITUTIONS))):
            name = self.names.unique(
                lambda: " ".join(
                    (self.names.word(2), r.choice(g.INSTITUTION_KINDS), "of", r.choice(g.INSTITUTION_FIELDS))
                )
            )
            self.institutions.append(
                Institution(name, self.year0 + r.randrange(0, 120), r.choice(self.cities))
            )
        self.people = []
        for _ in range(max(20, int(n * SHARE_PEOPLE))):
            inst = r.choice(self.institutions)
            self.people.append(
                Person(
                    self.person_name(),
                    r.choice(g.PROFESSIONS),
                    r.choice(self.cities),
                    inst.founded + r.randrange(20, 140),
                    inst,
                )
            )
        for p in self.people:
            if r.random() < MENTOR_RATE:
                mentor = r.choice(self.people)
                if mentor is not p:
                    p.mentor = mentor
        for inst in self.institutions:
            inst.director = r.choice(self.people)
        self.artifacts = []
        for _ in range(max(20, int(n * SHARE_ARTIFACTS))):
            kind = r.choice(g.ARTIFACT_KINDS)
            name = self.names.unique(lambda kind=kind: f"{self.names.word(r.choice((2, 3)))} {kind}")
            inventor = r.choice(self.people)
            self.artifacts.append(Artifact(name, kind, inventor.birth_year + r.randrange(20, 60), inventor))

    # -- questions ---------------------------------------------------------------------------
    def walk(self, start: Entity, chain: tuple[str, ...]) -> tuple[list[Entity], str] | None:
        """Follow ``chain`` from ``start``; the pages read and the answer, or None if a link is missing."""
        pages: list[Entity] = [start]
        cur: Entity = start
        for i, rel in enumerate(chain):
            last = i == len(chain) - 1
            value: Entity | str | None
            if rel == "birth_city":
                value = cur.birth_city.name if last else cur.birth_city
            elif rel == "institution":
                value = cur.institution
            elif rel == "mentor":
                value = cur.mentor
            elif rel == "inventor":
                value = cur.inventor
            elif rel == "director":
                value = cur.director.name if (last and cur.director) else cur.director
            elif rel == "founded":
                value = str(cur.founded)
            elif rel == "year":
                value = str(cur.year)
            elif rel == "province":
                value = cur.province
            else:  # pragma: no cover - templates and this walk are written together
                raise AssertionError(rel)
            if value is None:
                return None
            if last:
                return pages, value
            pages.append(value)
            cur = value
        return None

    def make_questions(self) -> list[Question]:
        r = self.rng
        pools = {"person": self.people, "artifact": self.artifacts, "institution": self.institutions}
        # Test first, then dev, then train: with no dev split the RNG draws what it drew before the
        # dev split existed, so older worlds stay byte-identical.
        wanted = [("test", t, self.per_tier) for t in TIERS]
        wanted += [("dev", t, self.dev_per_tier) for t in TIERS]
        wanted += [
            ("train", "easy", self.train_easy),
            ("train", "medium", self.train_medium),
            ("train", "hard", self.train_hard),
        ]
        used_starts: set[int] = set()
        # The pages each held-out split reads. A train question may read none of them, so held-out
        # accuracy measures searching and copying, not facts remembered from training; a dev question
        # reads no test page either, so choices made on dev learn nothing of the test questions.
        held_pages: dict[str, set[int]] = {"test": set(), "dev": set()}
        forbidden = {"test": (), "dev": ("test",), "train": ("test", "dev")}
        questions: list[Question] = []
        for split, tier, count in wanted:
            templates = [t for t in g.QUESTION_TEMPLATES if t.tier == tier]
            made = 0
            attempts = 0
            while made < count:
                attempts += 1
                if attempts > 200 * (count + 1):
                    raise ToyWorldError(
                        f"could not make {count} {tier} {split} questions from {self.n_docs} documents; "
                        "use more --docs or fewer questions"
                    )
                template = templates[made % len(templates)]
                start = r.choice(pools[template.start])
                if id(start) in used_starts:
                    continue
                walked = self.walk(start, template.chain)
                if walked is None:
                    continue
                pages, answer = walked
                # Pages on a chain must be distinct documents (a person cannot be their own mentor's mentor).
                if len({id(p) for p in pages}) != len(pages):
                    continue
                if any(id(p) in held_pages[other] for p in pages for other in forbidden[split]):
                    continue
                if split in held_pages:
                    held_pages[split].update(id(p) for p in pages)
                used_starts.add(id(start))
                made += 1
                slots = {"institution": getattr(start, "name", ""), "artifact": getattr(start, "name", "")}
                if isinstance(start, Person):
                    slots.update(person=start.name, profession=start.profession)
                query = template.text.format(**slots)
                questions.append(Question("", query, answer, tier, split, template.key, pages))
        return questions

    # -- distractors -------------------------------------------------------------------------
    def add_distractors(self, questions: list[Question]) -> None:
        """Near-duplicates of every page on a hard chain: same name, another profession or kind."""
        r = self.rng
        taken_titles = {p.title for p in self.people}
        self.distractors: list[Entity] = []
        for q in questions:
            if q.tier != "hard":
                continue
            for page in q.chain:
                if isinstance(page, Person):
                    for _ in range(NAMESAKES_PER_HARD_PERSON):
                        prof = r.choice([p for p in g.PROFESSIONS if p != page.profession])
                        if g.person_title(page.name, prof) in taken_titles:
                            continue
                        taken_titles.add(g.person_title(page.name, prof))
                        twin = Person(
                            page.name,
                            prof,
                            r.choice(self.cities),
                            page.birth_year + r.choice((-3, -2, -1, 1, 2, 3)),
                            r.choice(self.institutions),
                            r.choice(self.people),
                        )
                        self.distractors.append(twin)
                elif isinstance(page, Artifact):
                    base = page.name.rsplit(" ", 1)[0]
                    for _ in range(NAMESAKES_PER_HARD_ARTIFACT):
                        kind = r.choice([k for k in g.ARTIFACT_KINDS if k != page.kind])
                        name = f"{base} {kind}"
                        if name in self.names.used:
                            continue
                        self.names.used.add(name)
                        self.distractors.append(
                            Artifact(name, kind, page.year + r.choice((-2, -1, 1, 2)), r.choice(self.people))
                        )

    # -- documents ---------------------------------------------------------------------------
    def filler(self, k: int) -> str:
        r = self.rng
        out = []
        for _ in range(k):
            shape = r.randrange(4)
            if shape == 0:
                out.append(
                    f"Visitors often {r.choice(g.FILLER_VERBS)} the {r.choice(g.FILLER_ADJECTIVES)} "
                    f"{r.choice(g.FILLER_NOUNS)} near the {r.choice(g.FILLER_NOUNS)}."
                )
            elif shape == 1:
                adjective = r.choice(g.FILLER_ADJECTIVES)
                out.append(
                    f"Later accounts {r.choice(g.FILLER_VERBS)} {g.article(adjective)} {adjective} "
                    f"{r.choice(g.FILLER_NOUNS)} and a {r.choice(g.FILLER_NOUNS)} "
                    f"of {r.choice(self.cities).name}."
                )
            elif shape == 2:
                adjective = r.choice(g.FILLER_ADJECTIVES)
                out.append(
                    f"In {self.year0 + r.randrange(0, 260)} {g.article(adjective)} {adjective} "
                    f"{r.choice(g.FILLER_NOUNS)} was {r.choice(g.FILLER_VERBS)} by local historians."
                )
            else:
                adjective = r.choice(g.FILLER_ADJECTIVES)
                out.append(
                    f"The {r.choice(g.FILLER_NOUNS)} is mentioned in {g.article(adjective)} {adjective} "
                    f"{r.choice(g.FILLER_NOUNS)} kept at the {r.choice(self.institutions).name}."
                )
        return " ".join(out)

    def page_text(self, e: Entity) -> tuple[str, str]:
        """(title, body) of an entity's page."""
        r = self.rng
        if isinstance(e, Person):
            facts = [
                g.PERSON_FACTS[0].format(
                    name=e.name,
                    a=g.article(e.profession),
                    profession=e.profession,
                    city=e.birth_city.name,
                    year=e.birth_year,
                ),
                g.PERSON_FACTS[1].format(name=e.name, institution=e.institution.name),
            ]
            if e.mentor is not None:
                facts.append(
                    g.PERSON_MENTOR.format(
                        name=e.name, mentor_profession=e.mentor.profession, mentor=e.mentor.name
                    )
                )
            title = e.title
        elif isinstance(e, Artifact):
            facts = [
                g.ARTIFACT_FACTS[0].format(artifact=e.name, a=g.article(e.kind), kind=e.kind, year=e.year),
                g.ARTIFACT_FACTS[1].format(
                    artifact=e.name, inventor_profession=e.inventor.profession, inventor=e.inventor.name
                ),
            ]
            title = e.name
        elif isinstance(e, Institution):
            facts = [g.INSTITUTION_FACTS[0].format(institution=e.name, year=e.founded, city=e.city.name)]
            if e.director is not None:
                facts.append(
                    g.INSTITUTION_FACTS[1].format(
                        director_profession=e.director.profession, director=e.director.name
                    )
                )
            title = e.name
        else:
            facts = [
                g.CITY_FACTS[0].format(city=e.name, province=e.province),
                g.CITY_FACTS[1].format(population=e.population),
            ]
            title = e.name
        paragraphs = [" ".join(facts) + " " + self.filler(r.randrange(2, 5)), self.filler(r.randrange(3, 9))]
        return title, "\n\n".join(paragraphs)

    def chronicle_text(self, number: int) -> tuple[str, str]:
        """A page that mentions entities without stating their facts (retrieval noise)."""
        r = self.rng
        city = r.choice(self.cities)
        person, other = r.choice(self.people), r.choice(self.people)
        artifact = r.choice(self.artifacts)
        title = f"{city.name} Chronicle, issue {number}"
        body = (
            f"During the {r.choice(g.FILLER_ADJECTIVES)} season, {person.name} and {other.name} "
            f"exhibited the {artifact.name} in {city.name}. " + self.filler(r.randrange(3, 7)) + "\n\n"
            f"A letter from the {r.choice(self.institutions).name} "
            f"asked about the {r.choice(self.artifacts).name}. " + self.filler(r.randrange(2, 6))
        )
        return title, body

    def entity_pages(self) -> Iterator[Entity]:
        yield from self.cities
        yield from self.institutions
        yield from self.people
        yield from self.artifacts
        yield from self.distractors

    def build(self) -> World:
        self.build_graph()
        questions = self.make_questions()
        self.add_distractors(questions)
        entities = list(self.entity_pages())
        n_chronicles = self.n_docs - len(entities)
        if n_chronicles < 0:
            raise ToyWorldError(
                f"{len(entities)} entity pages do not fit in {self.n_docs} documents; use more --docs"
            )
        docids = [str(d) for d in self.rng.sample(range(100, 100 + 10 * self.n_docs), self.n_docs)]
        corpus: list[dict[str, str]] = []
        docid_of: dict[str, str] = {}
        for e in entities:
            title, body = self.page_text(e)
            docid = docids[len(corpus)]
            docid_of[title] = docid
            corpus.append({"docid": docid, "text": g.front_matter(title, body), "url": g.url_for(title)})
        for i in range(n_chronicles):
            title, body = self.chronicle_text(i + 1)
            corpus.append(
                {"docid": docids[len(corpus)], "text": g.front_matter(title, body), "url": g.url_for(title)}
            )
        # Interleave entity and chronicle pages so file order says nothing about a page's role.
        self.rng.shuffle(corpus)
        by_docid = {d["docid"]: d for d in corpus}
        splits: dict[str, list[dict]] = {"test": [], "dev": [], "train": []}
        # Numeric ids as BrowseComp-Plus has them: test 1.., dev after test, train from 1001 (or past dev).
        n_test = sum(q.split == "test" for q in questions)
        n_held = n_test + sum(q.split == "dev" for q in questions)
        first = {"test": 1, "dev": n_test + 1, "train": max(1000, n_held) + 1}
        for q in questions:
            target = splits[q.split]
            qid = str(first[q.split] + len(target))
            evidence = [by_docid[docid_of[_title(p)]] for p in q.chain]
            target.append(
                {
                    "query_id": qid,
                    "query": q.query,
                    "answer": q.answer,
                    "data_source": q.data_source(),
                    "evidence_docs": evidence,
                    "gold_docs": evidence[-1:],
                    "template": q.template,
                }
            )
        return World(self.seed, corpus, splits["test"], splits["train"], docid_of, splits["dev"])


def _title(e: Entity) -> str:
    return e.title if isinstance(e, Person) else e.name


def generate_world(
    n_docs: int = 2000,
    seed: int = 0,
    *,
    questions_per_tier: int = 50,
    train_medium: int = 100,
    train_hard: int = 50,
    train_easy: int = 0,
    dev_per_tier: int = 0,
) -> World:
    """Build the whole world in memory. Deterministic in its arguments.

    No train question reads a page (evidence document) that a test or dev question reads, and no dev
    question reads a test question's page. `dev_per_tier` 0 (no dev split) gives the world this
    generator gave before it had one, byte for byte.
    """
    builder = _Builder(n_docs, seed, questions_per_tier, train_medium, train_hard, train_easy, dev_per_tier)
    return builder.build()


# --- files ---------------------------------------------------------------------------------------


def _dump_jsonl(rows: list[dict], path: Path) -> str:
    h = hashlib.sha256()
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            line = json.dumps(row, ensure_ascii=False) + "\n"
            f.write(line)
            h.update(line.encode())
    return h.hexdigest()


def _qrels(rows: list[dict], key: str) -> str:
    return "".join(f"{q['query_id']} Q0 {d['docid']} 1\n" for q in rows for d in q[key])


def write_world(world: World, out: Path) -> dict[str, str]:
    """Write the world's files into ``out`` atomically (a temporary sibling, then rename).

    Returns the file names with their sha256. ``out`` must not exist or be empty.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ToyWorldError(f"{out} is not empty; remove it or choose another --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    digests = {
        "corpus.jsonl": _dump_jsonl(world.corpus, tmp / "corpus.jsonl"),
        "questions.jsonl": _dump_jsonl(world.test, tmp / "questions.jsonl"),
        "train.jsonl": _dump_jsonl(world.train, tmp / "train.jsonl"),
    }
    if world.dev:
        digests["dev.jsonl"] = _dump_jsonl(world.dev, tmp / "dev.jsonl")
    for name, key in (("qrel_evidence.txt", "evidence_docs"), ("qrel_golds.txt", "gold_docs")):
        text = _qrels(world.test + world.dev + world.train, key)
        (tmp / name).write_text(text, encoding="utf-8")
        digests[name] = hashlib.sha256(text.encode()).hexdigest()
    manifest = {**world.manifest(), "files": digests}
    (tmp / "world.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return digests


def load_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
