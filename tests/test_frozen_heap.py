"""frozen_heap: what existed before the block is left out of collections during it, and handed back after."""
from __future__ import annotations

import gc
import weakref

from rlflow.search.frozen_heap import frozen_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_freezes_then_hands_back_and_still_collects_new_cycles():
    before = gc.get_freeze_count()
    assert before == 0
    old = _Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():  # the inner block leaves the freeze to the outer one
            pass
        assert gc.get_freeze_count() > 0
        new = weakref.ref(_Cycle())  # a cycle made inside the block is garbage the collector still finds
        gc.collect()
        assert new() is None
    assert gc.get_freeze_count() == 0
    gone = weakref.ref(old)
    del old
    gc.collect()  # a cycle from before the block is collected again once it ends
    assert gone() is None
