"""Packed SFT rows: several documents per row of `max_length`, attention kept inside each document.

`pack` places whole tokenised documents into rows with TRL's best-fit-decreasing `pack_dataset`
(a `seq_lengths` column per row; `bfd_split` splits documents longer than a row). `PackedCollator`
keeps the rows of a batch separate, padded to the longest, so attention costs batch x L^2, not the
(batch x L)^2 of TRL's padding-free batch (one flattened row). Each batch's document boundaries are
built once, in the collator, and every layer reuses them:

- `position_ids` restart at 0 for each document (padding: 0, a one-token block of its own). With no
  2D `attention_mask` and no cache (the batch says `use_cache=False`), transformers turns them into
  one 4D block-diagonal causal mask per forward for sdpa / eager (the CPU path), shared by all layers.
  No 4D mask travels in the batch: the Trainer counts non-padding tokens as `attention_mask.sum()`;
- `cu_seq_lens_q/k` and `max_length_q/k` over the flattened rows: the varlen kernels of
  `flash_attention_2/3` (GPU, `model.attn_implementation`) read them instead of deriving them in
  every layer (sdpa ignores them).

A document's first label is masked: it would be predicted from the previous document's last token.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import pack_dataset
from trl.trainer.utils import pad

PACKED_STRATEGIES = ("bfd", "bfd_split")


def applies(stage: Any) -> bool:
    """Whether the stage trains on our packed rows (`packing` with a bfd strategy, not TRL's `padding_free`)."""
    return bool(stage.packing) and stage.packing_strategy in PACKED_STRATEGIES and not stage.padding_free


def pack(dataset: Any, max_length: int, strategy: str = "bfd") -> Any:
    """Tokenised rows (`input_ids`, optional `assistant_masks`) packed into rows of at most `max_length` tokens."""
    columns = [c for c in ("input_ids", "assistant_masks") if c in dataset.column_names]
    return pack_dataset(dataset.select_columns(columns), max_length, strategy)


def position_ids(seq_lengths: list[int], width: int) -> torch.Tensor:
    """Positions restarting at 0 for each document, then 0 for each padding slot up to `width`."""
    positions = torch.zeros(width, dtype=torch.long)
    start = 0
    for length in seq_lengths:
        positions[start:start + length] = torch.arange(length)
        start += length
    return positions


class PackedCollator:
    """Collates packed rows (`input_ids`, `labels`, `seq_lengths`) into a batch of separate rows."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        """The batch: input_ids, labels, position_ids, the varlen boundaries; no attention mask, no cache."""
        ids = pad([torch.as_tensor(e["input_ids"]) for e in examples], padding_value=self.pad_token_id,
                  padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of)
        labels = pad([torch.as_tensor(e.get("labels", e["input_ids"])) for e in examples], padding_value=-100,
                     padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of)
        positions = torch.stack([position_ids(e["seq_lengths"], ids.shape[1]) for e in examples])
        labels[positions == 0] = -100
        starts = (positions.flatten() == 0).nonzero().flatten()
        cu_seq_lens = torch.cat([starts, torch.tensor([positions.numel()])]).to(torch.int32)
        longest = int(cu_seq_lens.diff().max())
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu_seq_lens,
                "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest, "use_cache": False}


def collator(tok: Any) -> PackedCollator:
    """The packed-row collator for a tokenizer (pads with its pad token)."""
    return PackedCollator(tok.pad_token_id)
