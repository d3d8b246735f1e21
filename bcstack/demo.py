"""`make demo`: the main job on embedded defaults.

The demo needs the retrieval, worker, coordinator and judge services (issues 3-7). Until they
exist it says what it will do and exits non-zero, so nobody mistakes it for a finished run.
"""

import sys

PLAN = """\
make demo (not built yet) will, on embedded defaults with no GPU and no network:
  1. build what is missing: the toy world (2,000 documents, 150 test questions), the tiny
     Qwen3-architecture model, and the BM25 + dense indexes;
  2. `bcstack up`: start retrieval, the CPU engine, the worker, the scripted coordinator LLM,
     the coordinator gateway and the rule-based judge as processes on loopback ports;
  3. run an evaluation round over the 150-question toy test split with the scripted expert
     worker and with the untrained tiny model, and print the seed-001 table for each plus
     the paired comparison (improved/regressed, delta with a 95% interval);
  4. point to the PNG summary and to each service's /metrics, then `bcstack down`.
What works today: `bcstack toyworld generate` and `bcstack model tiny` (see README).
"""


def main() -> int:
    sys.stderr.write(PLAN)
    return 2


if __name__ == "__main__":
    sys.exit(main())
