"""A tiny text-classification task for the training-loop examples: BERT from a config (random weights, no
download), token-id sentences of different lengths, and a collator that pads each batch to its own longest.

Each example has a `text` column the model does not take, as a tokenized dataset usually has: Trainer drops
the columns `forward` does not name, so the result fxopt returns must name the model's.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 100


def tiny_bert() -> transformers.BertForSequenceClassification:
    """BertForSequenceClassification, 2 layers, hidden size 64, the library's defaults (SDPA attention, dropout 0.1)."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def sentences(n: int, seed: int) -> list[dict]:
    """`n` examples of 4 to 16 token ids, a label, and a `text` column the model does not take."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 17, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        label = int(torch.randint(0, 2, (1,), generator=g))
        rows.append({"input_ids": ids, "labels": label, "text": " ".join(map(str, ids))})
    return rows


def pad_to_longest(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Like DataCollatorWithPadding: each batch padded (with 0) to its own longest, with an attention mask."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([row["labels"] for row in rows])}
