"""Moved: each fused op's record lives with its pattern (``gdnpass/patterns/<name>/record.py``), the record type in
:mod:`gdnpass.patterns.record`, and the registry (:mod:`gdnpass.patterns`) lists them. gdnpass reads the registry;
this module only re-exports the old names for code that still imports them (tests/test_structure.py).
"""

from gdnpass.patterns import RECORDS
from gdnpass.patterns import record_of as record
from gdnpass.patterns.conv_chain.record import NORMS
from gdnpass.patterns.conv_chain.record import RECORD as CONV_CHAIN
from gdnpass.patterns.mat_vec_pair.record import RECORD as MAT_VEC_PAIR
from gdnpass.patterns.record import BOOL, INT, INTS, NAMES, NUM, Adapter, FusedOp, Param

__all__ = ["BOOL", "CONV_CHAIN", "INT", "INTS", "MAT_VEC_PAIR", "NAMES", "NORMS", "NUM", "RECORDS", "Adapter",
           "FusedOp", "Param", "record"]
