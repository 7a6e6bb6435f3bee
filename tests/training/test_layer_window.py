"""The replay walk's prefetch window and the reload-or-recompute plan (pure parts: no model)."""

from __future__ import annotations

import threading
import time

import pytest

from alchemist.training.hedge import CostModel, plan
from alchemist.training.layer_window import LayerWindow


class Reads:
    """A read function that counts layers read but not yet taken (the window's memory)."""

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.fail_at, self.delay_s = fail_at, delay_s
        self.read: list[int] = []
        self.taken = 0
        self.most_ahead = 0
        self.lock = threading.Lock()

    def __call__(self, layer: int) -> dict:
        time.sleep(self.delay_s)
        if layer == self.fail_at:
            raise KeyError(f"layer {layer} is gone")
        with self.lock:
            self.read.append(layer)
            self.most_ahead = max(self.most_ahead, len(self.read) - self.taken)
        return {"layer": layer}


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_window_gives_layers_in_order_and_reads_at_most_depth_ahead(depth):
    reads = Reads(delay_s=0.001)
    order = list(reversed(range(8)))
    with LayerWindow(reads, order, depth) as window:
        for layer in order:
            time.sleep(0.005)  # the walk is slower than the reader: the reader runs ahead, up to the window
            assert window.take(layer) == {"layer": layer}
            reads.taken += 1
    assert reads.read == order
    # depth 0 reads in the walk's thread, one at a time; else at most `depth` ahead of the one the walk holds.
    assert reads.most_ahead == max(depth, 1)


def test_window_raises_a_failed_read_where_the_walk_takes_that_layer():
    reads = Reads(fail_at=2)
    window = LayerWindow(reads, [4, 3, 2, 1, 0], depth=2)
    assert window.take(4) == {"layer": 4} and window.take(3) == {"layer": 3}
    with pytest.raises(KeyError, match="layer 2 is gone"):
        window.take(2)
    window.close()
    assert 1 not in reads.read  # the reader stopped at the failure


def test_window_refuses_out_of_order_takes_and_closes_early():
    window = LayerWindow(Reads(), [2, 1, 0], depth=1)
    with pytest.raises(RuntimeError, match="next in order is 2"):
        window.take(1)
    window.close()  # a walk that ended early: the blocked reader stops
    assert window._thread is None
    with pytest.raises(ValueError, match="depth"):
        LayerWindow(Reads(), [0], depth=-1)


def test_plan_reloads_from_memory_and_hedges_a_slow_tier():
    costs = CostModel(walk_s_per_row=1e-3, recompute_s_per_row=0.5e-3)
    rows, layer_bytes, input_bytes = 100, 1_000_000, 100_000
    # Nothing measured for a tier yet, or a fast one: reload every layer.
    assert plan(6, rows, "host", layer_bytes, input_bytes, costs).num_recomputed == 0
    costs.observe_read("host", 10_000_000, 0.001)  # 10 GB/s: 0.1 ms a layer, far below the walk's 100 ms
    assert plan(6, rows, "host", layer_bytes, input_bytes, costs).num_recomputed == 0
    # A disk that needs 250 ms a layer, against a walk and a recomputation of 100 ms each: hedge.
    costs = CostModel(walk_s_per_row=1e-3, recompute_s_per_row=1e-3)
    costs.observe_read("disk", layer_bytes, 0.25)
    hedged = plan(6, rows, "disk", layer_bytes, input_bytes, costs)
    assert 0 < hedged.num_recomputed < 6
    assert hedged.recompute[-1]  # the top layer is needed first: recomputing it beats waiting 250 ms for it
    # Reads and recomputations overlap: the mix beats reloading everything and recomputing everything.
    reload_all = 6 * 0.25 + 0.1  # the reader's total, then the last layer's walk
    recompute_all = 0.025 + 6 * (0.1 + 0.1)  # the first input read, then per layer: recompute, walk
    assert hedged.predicted_s < min(reload_all, recompute_all) - 0.2
    # The walk also differentiates the live rows: 100 more rows double each layer's walk, so waiting for the
    # disk costs less by comparison, and fewer layers are recomputed.
    with_live = plan(6, rows, "disk", layer_bytes, input_bytes, costs, walk_rows=2 * rows)
    assert with_live.num_recomputed < hedged.num_recomputed
    assert with_live.predicted_s > hedged.predicted_s


def test_cost_model_running_estimates():
    costs = CostModel()
    assert costs.read_s("disk", 1000) == 0.0 and costs.recompute_s(10) == float("inf")
    costs.observe_walk(10, 1.0)
    assert costs.recompute_s(10) == pytest.approx(0.5)  # half a walk layer until a recomputation is measured
    costs.observe_recompute(10, 0.2)
    costs.observe_read("disk", 1000, 1.0)
    costs.observe_read("disk", 1000, 2.0)  # slower now: the estimate moves towards it
    assert costs.recompute_s(10) == pytest.approx(0.2)
    assert 1.0 < costs.read_s("disk", 1000) < 2.0
