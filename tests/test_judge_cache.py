"""The judge's verdict cache: identical grading requests reach the grader at most once, across
concurrent callers (coalescing) and across restarts (the SQLite file), failures are never cached."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.judge.cache import CacheError, VerdictCache

REPO = Path(__file__).resolve().parents[1]
KEY = VerdictCache.key("openai", "Is {answer} right?", "grader", {"answer": "42", "truth": "42"})
VERDICT = {"correct": True, "confidence": 0.9, "notes": ["exact match"]}


class Grader:
    """A stand-in grader: counts calls; blocks on `release` when one is given."""

    def __init__(self, value: dict | None = None, *, release: asyncio.Event | None = None, error=None):
        self.value = value if value is not None else dict(VERDICT)
        self.release = release
        self.error = error
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        if self.release is not None:
            await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.value


async def _until_called(grader: Grader) -> None:
    """Wait until the shared computation has started, then let every queued caller reach its await."""
    while grader.calls == 0:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=30
    )


def test_hundred_identical_concurrent_requests_call_the_grader_once(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "cache.sqlite")

    async def main() -> list[tuple[dict, str]]:
        grader = Grader(release=asyncio.Event())
        tasks = [asyncio.create_task(cache.get_or_compute(KEY, grader)) for _ in range(100)]
        await _until_called(grader)
        assert not any(task.done() for task in tasks)
        grader.release.set()
        results = await asyncio.gather(*tasks)
        assert grader.calls == 1
        return results

    results = asyncio.run(main())
    hows = [how for _, how in results]
    assert hows.count("miss") == 1 and hows.count("coalesced") == 99
    assert all(value == VERDICT for value, _ in results)
    assert cache.stats == {"hit": 0, "miss": 1, "coalesced": 99}
    assert cache.count() == 1
    cache.close()


def test_every_field_of_a_request_changes_the_key_but_input_order_does_not() -> None:
    base = {
        "grader": "openai",
        "template": "T {answer}",
        "model": "m",
        "inputs": {"answer": "a", "truth": "b"},
    }
    key = VerdictCache.key(**base)
    variants = [
        {**base, "grader": "rule"},
        {**base, "template": "T {answer}."},
        {**base, "model": "m2"},
        {**base, "inputs": {"answer": "a ", "truth": "b"}},
        {**base, "inputs": {"answer": "a", "truth2": "b"}},
        {**base, "inputs": {"answer": "a", "truth": "b", "question": ""}},
        {**base, "inputs": {"answer": "b", "truth": "a"}},
        # Text shifted from one field to its neighbour must not collide.
        {**base, "template": "T {answer}m", "model": ""},
    ]
    keys = [VerdictCache.key(**variant) for variant in variants]
    assert key not in keys and len(set(keys)) == len(keys)
    assert VerdictCache.key(**{**base, "inputs": {"truth": "b", "answer": "a"}}) == key
    assert len(key) == 64 and int(key, 16) >= 0


def test_a_stored_verdict_is_a_hit_in_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "state" / "cache.sqlite"  # the parent directory does not exist yet
    cache = VerdictCache(path)
    assert asyncio.run(cache.get_or_compute(KEY, Grader())) == (VERDICT, "miss")
    cache.close()

    done = _run_python(f"""
        import asyncio, json
        from pathlib import Path
        from services.judge.cache import VerdictCache

        async def grader():
            raise AssertionError("the grader was called on restart")

        cache = VerdictCache(Path({str(path)!r}))
        value, how = asyncio.run(cache.get_or_compute({KEY!r}, grader))
        print(json.dumps([value, how]))
    """)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [VERDICT, "hit"]


def test_a_verdict_survives_the_process_being_killed_right_after_it_returned(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    done = _run_python(f"""
        import asyncio, os, signal
        from pathlib import Path
        from services.judge.cache import VerdictCache

        async def grader():
            return {VERDICT!r}

        cache = VerdictCache(Path({str(path)!r}))
        asyncio.run(cache.get_or_compute({KEY!r}, grader))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert done.returncode == -9, done.stderr

    cache = VerdictCache(path)
    grader = Grader(value={"correct": False})
    assert asyncio.run(cache.get_or_compute(KEY, grader)) == (VERDICT, "hit")
    assert grader.calls == 0
    cache.close()


def test_a_failing_grader_reaches_every_waiter_and_nothing_is_stored(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "cache.sqlite")

    async def main() -> None:
        failing = Grader(release=asyncio.Event(), error=TimeoutError("grader timed out"))
        tasks = [asyncio.create_task(cache.get_or_compute(KEY, failing)) for _ in range(5)]
        await _until_called(failing)
        failing.release.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert failing.calls == 1
        assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)

        assert cache.get(KEY) is None and cache.count() == 0
        working = Grader()
        assert await cache.get_or_compute(KEY, working) == (VERDICT, "miss")
        assert working.calls == 1

    asyncio.run(main())
    cache.close()


def test_a_verdict_that_keep_rejects_is_not_stored(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "cache.sqlite")
    unparsed = Grader(value={"parsed": False})

    async def main() -> None:
        for _ in range(2):
            assert await cache.get_or_compute(KEY, unparsed, keep=lambda v: v["parsed"]) == (
                {"parsed": False},
                "miss",
            )
        assert unparsed.calls == 2 and cache.count() == 0 and cache.get(KEY) is None

        parsed = Grader(value={"parsed": True})
        assert (await cache.get_or_compute(KEY, parsed, keep=lambda v: v["parsed"]))[1] == "miss"
        assert (await cache.get_or_compute(KEY, parsed, keep=lambda v: v["parsed"]))[1] == "hit"
        assert parsed.calls == 1

    asyncio.run(main())
    cache.close()


def test_a_cancelled_waiter_does_not_cancel_the_others(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "cache.sqlite")

    async def main() -> None:
        grader = Grader(release=asyncio.Event())
        # The first caller started the computation; cancelling it must not take it down.
        first, *others = [asyncio.create_task(cache.get_or_compute(KEY, grader)) for _ in range(3)]
        await _until_called(grader)
        first.cancel()
        await asyncio.sleep(0.01)
        grader.release.set()
        assert await asyncio.gather(*others) == [(VERDICT, "coalesced")] * 2
        assert first.cancelled() and grader.calls == 1

    asyncio.run(main())
    cache.close()


def test_a_computation_whose_waiters_all_left_still_stores_its_verdict(tmp_path: Path) -> None:
    # A client that timed out and retries must not pay for a second grader call.
    cache = VerdictCache(tmp_path / "cache.sqlite")

    async def main() -> None:
        grader = Grader(release=asyncio.Event())
        waiter = asyncio.create_task(cache.get_or_compute(KEY, grader))
        await _until_called(grader)
        waiter.cancel()
        await asyncio.sleep(0.01)
        grader.release.set()
        retry = await cache.get_or_compute(KEY, grader)
        assert retry in [(VERDICT, "coalesced"), (VERDICT, "hit")]
        assert grader.calls == 1 and cache.count() == 1

    asyncio.run(main())
    cache.close()


def test_returned_verdicts_are_copies(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "cache.sqlite")

    async def main() -> None:
        value, _ = await cache.get_or_compute(KEY, Grader())
        value["notes"].append("mutated by a caller")
        hit, how = await cache.get_or_compute(KEY, Grader())
        assert (hit, how) == (VERDICT, "hit")
        hit["correct"] = False
        assert cache.get(KEY) == VERDICT

    asyncio.run(main())
    cache.close()


def test_a_file_that_is_not_a_verdict_cache_is_refused_by_name(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database, just some bytes\n" * 200)
    with pytest.raises(CacheError, match=str(garbage)):
        VerdictCache(garbage)

    foreign = tmp_path / "records.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE episodes (episode_id TEXT PRIMARY KEY)")
    with pytest.raises(CacheError, match=str(foreign)):
        VerdictCache(foreign)


def test_a_damaged_row_is_graded_again_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    VerdictCache(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO verdicts VALUES (?, ?, 0)", (KEY, "{truncated"))

    cache = VerdictCache(path)
    grader = Grader()
    assert asyncio.run(cache.get_or_compute(KEY, grader)) == (VERDICT, "miss")
    cache.close()
    assert VerdictCache(path).get(KEY) == VERDICT


def test_without_a_file_requests_still_coalesce_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cache = VerdictCache(None)

    async def main() -> list[str]:
        grader = Grader(release=asyncio.Event())
        tasks = [asyncio.create_task(cache.get_or_compute(KEY, grader)) for _ in range(10)]
        await _until_called(grader)
        grader.release.set()
        hows = [how for _, how in await asyncio.gather(*tasks)]
        assert grader.calls == 1
        return hows

    hows = asyncio.run(main())
    assert sorted(hows) == ["coalesced"] * 9 + ["miss"]
    assert list(tmp_path.iterdir()) == []
    cache.close()
