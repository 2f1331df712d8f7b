"""Helpers shared by the test files (issue 13: no test file imports another ``test_*.py``).

- ``support.arena``: kernel-test memory and calls: the NaN-poisoned uint8 :class:`~support.arena.Arena` of strided
  views, ``rnd``, ``assert_close`` (f32 agreement) and ``node`` (a stand-in graph node for the backend tables);
- ``support.compare``: byte-for-byte asserts on tensors;
- ``support.graphs``: building and planning small verify graphs, and the assert on a ``check_fusion`` result;
- ``support.soundness``: the search tools of tests/patterns/test_soundness.py;
- ``support.trips``: the trip graph record (:class:`~support.trips.Trip`) and what tests/patterns/test_rules.py asks
  of every registered pattern's ``tests/patterns/<folder>/trips.py``;
- ``support.surgery``: graph surgery on the small planned verify graph of the conv chain's and the pair's trips;
- ``support.attention_block``: a qwen35 attention block as ggml calls, made by gdnpass's constructors or by ggml.

pytest puts ``tests/`` on ``sys.path`` (``pythonpath = ["tests"]`` in pyproject.toml's [tool.pytest.ini_options]; the
test files themselves are imported by path, ``--import-mode=importlib``, so that the folders mirroring the package may
hold files of the same name), so a test file anywhere under tests/ imports ``from support.arena import Arena``, also
when run alone. The exactness sweep's case table is
product code, not a test helper: :mod:`gdnpass.sweep`.
"""
