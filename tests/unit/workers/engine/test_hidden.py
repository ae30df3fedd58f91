"""The hidden-state store holds a step's rows until something reads them, and what it reads is what
eager writes would have left."""

import pytest
import torch

from workers.engine import hidden as hidden_module
from workers.engine.hidden import HiddenStore

pytestmark = pytest.mark.unit

H = 4
LAYERS = (0, 2)


def step_rows(slots: list[int], value: float) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A forward pass's rows: row i of layer l holds value + 10 l + i."""
    n = len(slots)
    return torch.tensor(slots), {layer: (value + 10 * layer + torch.arange(n, dtype=torch.float32))[:, None]
                                 .expand(n, H).contiguous() for layer in LAYERS}


def eager(steps: list[tuple[list[int], float]], slots: int = 32) -> dict[int, torch.Tensor]:
    rows = {layer: torch.zeros(slots, H) for layer in LAYERS}
    for s, value in steps:
        index, hidden = step_rows(s, value)
        for layer in LAYERS:
            rows[layer].index_copy_(0, index, hidden[layer])
    return rows


def store_after(steps: list[tuple[list[int], float]], slots: int = 32) -> HiddenStore:
    store = HiddenStore(LAYERS, slots, H, torch.float32, "cpu")
    for s, value in steps:
        store.write(*step_rows(s, value))
    return store


@pytest.mark.parametrize("steps", [
    [([3, 4, 5], 100.0)],  # one step
    [([0, 1, 2, 3], 100.0), ([4], 200.0), ([5], 300.0)],  # a prefill, then decode steps
    [([0, 1, 2], 100.0), ([3, 4, 5], 200.0), ([1, 2], 300.0), ([2], 400.0)],  # slots written again: the latest wins
])
def test_reads_see_every_write_in_order(steps):
    store = store_after(steps)
    want = eager(steps)
    everything = torch.arange(32)
    assert all(torch.equal(got, want[layer]) for got, layer in zip(store.read(everything, LAYERS), LAYERS))
    out = torch.empty(32, len(LAYERS), H)
    store = store_after(steps)
    store.gather(everything, LAYERS, out)
    assert all(torch.equal(out[:, i], want[layer]) for i, layer in enumerate(LAYERS))


def test_rows_are_held_until_read():
    store = store_after([([0, 1], 100.0), ([2], 200.0)])
    assert not store._rows[0].any()  # nothing written yet: a step that asks nothing pays nothing
    store.land()
    assert torch.equal(store._rows[0], eager([([0, 1], 100.0), ([2], 200.0)])[0])


def test_a_tree_copy_moves_rows_written_before_it():
    store = store_after([([0, 1, 2, 3], 100.0)])
    store.copy(torch.tensor([2, 3]), torch.tensor([0, 1]))
    want = eager([([0, 1, 2, 3], 100.0)])[2]
    assert torch.equal(store.read(torch.tensor([0, 1]), (2,))[0], want[2:4])


def test_views_and_raw_tensor_users_write_at_once():
    store = HiddenStore(LAYERS, 32, H, torch.float32, "cpu")
    store.write(*step_rows([0], 100.0))
    store.write(*step_rows([1], 200.0), views=True)  # a CUDA graph's buffers: the next replay overwrites them
    assert torch.equal(store._rows[0][:2], eager([([0], 100.0), ([1], 200.0)])[0][:2])
    rows = store.rows  # the KV tiers copy blocks of these themselves: from now on every write lands at once
    store.write(*step_rows([2], 300.0))
    assert rows[2][2, 0] == 300.0 + 20


def test_what_is_held_is_bounded(monkeypatch):
    monkeypatch.setattr(hidden_module, "HOLD_ROWS", 4)
    store = store_after([([0, 1], 100.0), ([2], 200.0)])
    assert not store._rows[0].any()
    store.write(*step_rows([3], 300.0))  # the fourth row: all land
    assert torch.equal(store._rows[0], eager([([0, 1], 100.0), ([2], 200.0), ([3], 300.0)])[0])
