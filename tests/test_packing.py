"""Packed rows (pipeline/data/packing.py): the same loss as unpacked training, no attention across documents."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.data import packing

PAD = 0
TOLERANCE = 1e-5  # fp32 on CPU: summation order only


def tiny_model() -> LlamaForCausalLM:
    """A random 2-layer Llama on sdpa, in eval mode (no dropout)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


def documents(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token documents (ids 1..96) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=gen).tolist() for n in lengths]


def packed_batch(docs: list[list[int]], max_length: int) -> dict:
    """The documents packed by BFD into rows of max_length and collated."""
    rows = packing.pack(Dataset.from_dict({"input_ids": docs}), max_length)
    return packing.PackedCollator(PAD)([{**r, "labels": r["input_ids"]} for r in rows])


def unpacked_loss(model: LlamaForCausalLM, docs: list[list[int]]) -> torch.Tensor:
    """One padded row per document, as plain (unpacked) training batches them."""
    width = max(map(len, docs))
    ids = torch.tensor([d + [PAD] * (width - len(d)) for d in docs])
    mask = (torch.arange(width)[None] < torch.tensor([len(d) for d in docs])[:, None]).long()
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def test_packed_loss_equals_unpacked_loss():
    """Several documents per row give the loss (mean over the same predicted tokens) of one row per document."""
    model = tiny_model()
    docs = documents([30, 12, 25, 7, 18, 40, 9])
    batch = packed_batch(docs, max_length=64)
    assert batch["input_ids"].shape[0] < len(docs), "documents must share rows"
    with torch.no_grad():
        packed, plain = model(**batch).loss, unpacked_loss(model, docs)
    assert abs(packed.item() - plain.item()) < TOLERANCE, (packed.item(), plain.item())


def test_no_attention_across_documents():
    """Changing one document of a row leaves the logits of the other documents unchanged."""
    model = tiny_model()
    docs = documents([20, 15, 10])
    changed = [docs[0], documents([15], seed=1)[0], docs[2]]
    first, second = packed_batch(docs, max_length=64), packed_batch(changed, max_length=64)
    assert first["input_ids"].shape[0] == 1, "the three documents must share one row"
    with torch.no_grad():
        a, b = model(**first).logits[0], model(**second).logits[0]
    assert first["position_ids"][0, [0, 20, 35]].tolist() == [0, 0, 0], "rows laid out as documents 0, 1, 2"
    differs = (a - b).abs().amax(-1) > 1e-6
    assert differs[20:35].all(), "the changed document's own logits change"
    assert not differs[:20].any() and not differs[35:].any(), "the other documents' logits must not change"


def test_collator_marks_document_boundaries():
    """Positions restart per document, first labels are masked, cu_seq_lens cover the flattened rows."""
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]},
            {"input_ids": [1, 2], "labels": [1, 2], "seq_lengths": [2]}]
    batch = packing.PackedCollator(PAD)(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 2, -100, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 7, 8, 9, 10]
    assert batch["max_length_q"] == 3
