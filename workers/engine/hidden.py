"""Target hidden states for draft methods that read them (EAGLE, Medusa, MLP speculators).

The store keeps the hidden state of each offered layer at every KV cache slot: the row of the token
at position p of a sequence lives in the same slot as its keys and values
(``block_table[p // bs] * bs + p % bs``). So it follows the cache for free: a rollback frees the
slots, an accepted tree path moves its slots (:meth:`HiddenStore.copy`), a prefix-cache hit brings
the rows its blocks were computed with, and a preempted sequence recomputes them. Every forward pass
hands its rows to the store; a draft's request reads them by slot.

Rows are written lazily: a step's rows are held (references to the forward's outputs, no copy)
until something reads the store, and then every held step lands in one ``index_copy_`` per layer.
So while no draft is asked (the load-aware plan declines, the draft is backed off) a step pays
nothing for the rows a draft will need when drafting resumes; ``HOLD_ROWS`` bounds what is held.
Rows that are views of buffers a later forward overwrites (a CUDA graph's) are copied at once, and
once anyone takes the raw tensors (:attr:`HiddenStore.rows`: the KV tiers and a KV transfer agent
copy blocks of them on their own) every write lands at once.

The layers are fixed when the engine is built (the target *offers* them to draft workers), so the
model's captured CUDA graphs include them from the start and no draft can change them.
"""

from __future__ import annotations

import torch


HOLD_ROWS = 1024  # rows held unwritten at most (a long prefill chunk lands at once)


class HiddenStore:
    """Rows [num_slots, hidden] per offered layer; plain values in."""

    def __init__(self, layers: tuple[int, ...], num_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layers = tuple(layers)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._rows = {layer: torch.zeros(num_slots, hidden_size, dtype=dtype, device=device) for layer in self.layers}
        self._held: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []  # writes not landed yet, oldest first
        self._held_rows = 0
        self._eager = False  # someone holds the raw tensors: every write lands at once

    @property
    def rows(self) -> dict[int, torch.Tensor]:
        """The raw tensors, per offered layer, for a caller that copies them itself: every held write
        lands first, and every write from now on lands at once."""
        self.land()
        self._eager = True
        return self._rows

    @staticmethod
    def bytes_per_slot(num_layers: int, hidden_size: int, itemsize: int) -> int:
        return num_layers * hidden_size * itemsize

    def write(self, slots: torch.Tensor, hidden: dict[int, torch.Tensor], views: bool = False) -> None:
        """A forward pass's rows: slots [T] long, hidden[layer] [T, hidden] for every layer. Held until
        the store is read; ``views``: they are views of buffers the next forward overwrites (a CUDA
        graph's), so they land now."""
        if views or self._eager:
            self.land()
            self._index_copy(slots, hidden)
            return
        self._held.append((slots, hidden))
        self._held_rows += slots.shape[0]
        if self._held_rows >= HOLD_ROWS:
            self.land()

    @torch.inference_mode()
    def land(self) -> None:
        """Write every held step's rows as the steps would have in turn: where a slot was written more
        than once (a freed slot reused, a rejected draft's position decoded again) the latest row wins."""
        held, self._held, self._held_rows = self._held, [], 0
        if len(held) == 1:
            self._index_copy(*held[0])
            return
        if not held:
            return
        slots = torch.cat([s for s, _ in held])
        rows = {layer: torch.cat([h[layer] for _, h in held]) for layer in self.layers}
        latest = {slot: i for i, slot in enumerate(slots.tolist())}  # per slot, its last row
        if len(latest) < slots.shape[0]:
            keep = torch.tensor(list(latest.values()), dtype=torch.long, device=slots.device)
            slots, rows = slots[keep], {layer: r[keep] for layer, r in rows.items()}
        self._index_copy(slots, rows)

    @torch.inference_mode()
    def _index_copy(self, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        for layer, rows in self._rows.items():
            h = hidden[layer]
            rows.index_copy_(0, slots, h if h.dtype == rows.dtype else h.to(rows.dtype))

    @torch.inference_mode()
    def read(self, slots: torch.Tensor, layers: tuple[int, ...], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Per layer of ``layers`` (offered ones), rows [n, hidden] at ``slots`` [n] long, on the CPU in
        ``dtype`` (None: as stored): what a draft request carries."""
        self.land()
        return [self._rows[layer].index_select(0, slots).to("cpu", dtype or self.dtype) for layer in layers]

    @torch.inference_mode()
    def gather(self, slots: torch.Tensor, layers: tuple[int, ...], out: torch.Tensor) -> None:
        """Rows at ``slots`` [n] long of ``layers`` (offered, distinct) into ``out`` [n, len(layers),
        hidden] on the host, in the store's dtype: a data-plane block."""
        self.land()
        if out.device == slots.device:  # straight into the block: one copy per layer
            for i, layer in enumerate(layers):
                torch.index_select(self._rows[layer], 0, slots, out=out[:, i])
        else:  # one gather on the device, one copy to the host (a DMA into the pinned ring)
            out.copy_(torch.stack([self._rows[layer].index_select(0, slots) for layer in layers], 1))

    @torch.inference_mode()
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows src → dst (slots [n] long each): an accepted tree path moved into place."""
        self.land()
        for rows in self._rows.values():
            rows[dst] = rows[src]
