"""Helpers shared by the test files (issue 13: no test file imports another ``test_*.py``).

- ``support.arena``: kernel-test memory and calls: the NaN-poisoned uint8 :class:`~support.arena.Arena` of strided
  views, ``rnd``, ``assert_close`` (f32 agreement) and ``node`` (a stand-in graph node for the backend tables);
- ``support.compare``: byte-for-byte asserts on tensors;
- ``support.graphs``: building and planning small verify graphs, and the assert on a ``check_fusion`` result;
- ``support.soundness``: the search tools of tests/test_soundness.py.

pytest puts ``tests/`` on ``sys.path`` (tests/conftest.py lives there, rootdir-relative "prepend" import mode), so a
test file imports ``from support.arena import Arena``, also when run alone. The exactness sweep's case table is
product code, not a test helper: :mod:`gdnpass.sweep`.
"""
