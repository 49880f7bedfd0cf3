"""The order the test files run in: the longest first (conftest.py applies it to every run).

``make test`` runs two pytest-xdist workers with ``--dist loadfile``: a worker takes a whole
file, and the next one when it has two tests of its own left. The last files taken decide how
long the other worker idles at the end: in xdist's own order (the files with the most tests
first) the last ones were the one-test end-to-end runs, the resume test (75-110 s) among them.
Taking the files longest first (LPT scheduling) leaves the short unit-test files for the end,
where they fill in whichever worker frees first. ``--no-loadscope-reorder`` (Makefile) keeps
xdist from sorting the files again by their number of tests.

``SECONDS`` holds each slow file's seconds in the cold clean-clone runs of
docs/results/test_suite.md (``--durations`` summed per file, rounded), or alone on a loaded
machine where those runs listed too little of it. Only the order matters, so rough numbers do.
A file not listed counts as ``MEDIUM`` when one of its tests uses a fixture that starts Ray or
builds a policy (``HEAVY_FIXTURES``: a new such file is never left for the end), else as short;
files of equal seconds keep their collection order. A file's own tests keep their order (its
module fixtures are built once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

SECONDS = {
    "test_bench.py": 550,  # + the live_load, faults-under-load and scale benches (2026-11-29, ~300 s alone)
    "test_train_loop.py": 180,
    "test_live_e2e.py": 170,
    "test_survival.py": 160,
    "test_learner_ranks.py": 110,
    "test_storage.py": 105,
    "test_resume.py": 100,
    "test_services_e2e.py": 95,
    "test_ig_engine.py": 95,
    "test_weight_transport.py": 80,
    "test_smollm2.py": 140,
    "test_multinode.py": 65,
    "test_core_split.py": 60,
    "test_engine_service.py": 90,
    "test_gateway_http.py": 40,
    "test_services_fuzz.py": 30,
    "test_install_tool.py": 20,
    "test_eval_cli.py": 20,
    # guesses: no test of these is in the cold runs' top 25 (each under ~31 s there); alone on
    # a machine loaded 4-12 times over (2026-11-27 ~23:50) they took 251, 313, ~75, 97, 85, 83 s
    "test_weight_sync.py": 90,
    "test_reward_service.py": 90,
    "test_learner_update.py": 60,
    # alone, 2026-11-29 ~09:00, beside a training run (load ~4): the frameworks file's new tests
    # (AutoGen, LlamaIndex, Haystack, Agno, Node; the Agents SDK on Responses, HF and vLLM) ~230 s
    # on top of its 60; the gateway schema, Responses and streaming files 55, 45 and ~110 s
    "test_frameworks.py": 290,
    "test_gateway_streaming.py": 110,
    "test_gateway_schema.py": 55,
    "test_gateway_responses.py": 45,
    "test_rollout.py": 45,
    "test_reference_loop.py": 45,
    # two `turnrl train` runs of the tiny policy in subprocesses (bench/credit.py --quick): 113 s
    # in the suite of 2026-11-29 06:42 (12 held-out tasks then, 6 now)
    "test_credit.py": 110,
}
MEDIUM = 30
HEAVY_FIXTURES = frozenset({"ray_cluster", "tiny_policy", "agent_policy", "tiny_run_config"})


def longest_first(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place: whole files by their seconds, longest first; ties in
    collection order; each file's tests in their own order."""
    first: dict[str, int] = {}
    heavy: set[str] = set()
    for i, item in enumerate(items):
        first.setdefault(_file(item), i)
        if HEAVY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            heavy.add(_file(item))

    def key(item: pytest.Item) -> tuple[int, int]:
        f = _file(item)
        return -SECONDS.get(Path(f).name, MEDIUM if f in heavy else 0), first[f]

    items.sort(key=key)  # stable: a file's tests stay in their order


def _file(item: pytest.Item) -> str:
    """The file part of the item's node id: what ``--dist loadfile`` hands out whole."""
    return item.nodeid.split("::", 1)[0]
