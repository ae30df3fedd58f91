"""Target hidden states for draft methods that read them (EAGLE, Medusa, MLP speculators).

The store keeps the hidden state of each offered layer at every KV cache slot: the row of the token
at position p of a sequence lives in the same slot as its keys and values
(``block_table[p // bs] * bs + p % bs``). So it follows the cache for free: a rollback frees the
slots, an accepted tree path moves its slots (:meth:`HiddenStore.copy`), a prefix-cache hit brings
the rows its blocks were computed with, and a preempted sequence recomputes them. Every forward pass
writes its rows in one ``index_copy_`` per layer; a draft's request reads them by slot.

The layers are fixed when the engine is built (the target *offers* them to draft workers), so the
model's captured CUDA graphs include them from the start and no draft can change them.
"""

from __future__ import annotations

import torch


class HiddenStore:
    """Rows [num_slots, hidden] per offered layer; plain values in."""

    def __init__(self, layers: tuple[int, ...], num_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layers = tuple(layers)
        self.hidden_size = hidden_size
        self.rows = {layer: torch.zeros(num_slots, hidden_size, dtype=dtype, device=device) for layer in self.layers}

    @staticmethod
    def bytes_per_slot(num_layers: int, hidden_size: int, itemsize: int) -> int:
        return num_layers * hidden_size * itemsize

    @torch.inference_mode()
    def write(self, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """Store a forward pass's rows: slots [T] long, hidden[layer] [T, hidden] for every layer."""
        for layer, rows in self.rows.items():
            h = hidden[layer]
            rows.index_copy_(0, slots, h if h.dtype == rows.dtype else h.to(rows.dtype))

    @torch.inference_mode()
    def read(self, slots: torch.Tensor, layers: tuple[int, ...], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Per layer of ``layers`` (offered ones), rows [n, hidden] at ``slots`` [n] long, on the CPU in
        ``dtype`` (None: as stored): what a draft request carries."""
        return [self.rows[layer].index_select(0, slots).to("cpu", dtype or self.rows[layer].dtype) for layer in layers]

    @torch.inference_mode()
    def gather(self, slots: torch.Tensor, layers: tuple[int, ...], out: torch.Tensor) -> None:
        """Rows at ``slots`` [n] long of ``layers`` (offered, distinct) into ``out`` [n, len(layers),
        hidden] on the host, in the store's dtype: a data-plane block."""
        if out.device == slots.device:  # straight into the block: one copy per layer
            for i, layer in enumerate(layers):
                torch.index_select(self.rows[layer], 0, slots, out=out[:, i])
        else:  # one gather on the device, one copy to the host (a DMA into the pinned ring)
            out.copy_(torch.stack([self.rows[layer].index_select(0, slots) for layer in layers], 1))

    @torch.inference_mode()
    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows src → dst (slots [n] long each): an accepted tree path moved into place."""
        for rows in self.rows.values():
            rows[dst] = rows[src]
