"""fxopt in a plain PyTorch loop: the result is the model, its parameters are the model's.

    python examples/plain_loop.py

Trains a tiny BERT for two epochs with a memory budget, evaluates under `torch.no_grad()`, and saves the
model with its own `save_pretrained` (the result shares the model's parameters, so the model is trained).
"""
from __future__ import annotations

import sys
import tempfile

import torch
import transformers

import fxopt
from tiny_text_task import pad_to_longest, sentences, tiny_bert


def train(model: torch.nn.Module, epochs: int = 2) -> tuple[list[float], float]:
    """AdamW over 16 sentences in batches of 4; the loss of each step and the mean eval loss after training."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(sentences(16, seed=1), batch_size=4, shuffle=True, collate_fn=pad_to_longest,
                                         generator=torch.Generator().manual_seed(0))
    losses = []
    model.train()
    for _ in range(epochs):
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # another graph (no grad, eval-mode dropout): Dynamo compiles it on first use
        eval_loss = sum(model(**pad_to_longest(sentences(8, seed=2)[i:i + 4])).loss.item() for i in (0, 4)) / 2
    return losses, eval_loss


def main(output_dir: str) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = tiny_bert()
    optimized = fxopt.optimize(model, mode="training", memory_budget=0.5)
    losses, eval_loss = train(optimized)
    model.save_pretrained(output_dir)  # `optimized.save_pretrained(...)` is the same call
    print(f"losses {[round(x, 4) for x in losses]}; eval loss {eval_loss:.4f}; "
          f"graphs fxopt compiled: {len(optimized.fxopt_reports)}")
    return losses, eval_loss


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
