"""A 6-layer BERT (random weights, built from a config: no download) for `fxopt inspect` and `fxopt bench`.

    fxopt inspect examples/bert_small.py:bert6 --input-shape 4x128 --dtype int64 --int-high 1000 \\
        --mode training --memory-budget 0.5 --html bert6.html
"""
from __future__ import annotations

import transformers


def bert6() -> transformers.BertModel:
    """BERT with 6 layers, hidden size 256, 4 heads, a 1000-token vocabulary; token ids in, hidden states out."""
    config = transformers.BertConfig(num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                                     intermediate_size=1024, vocab_size=1000, max_position_embeddings=128,
                                     attn_implementation="eager")
    return transformers.BertModel(config)
