"""fxopt with Hugging Face Accelerate: `accelerator.prepare` what `fxopt.optimize` returns, as you would the model.

    python examples/accelerate_loop.py [no|bf16]

One process; "bf16" runs the forward under CPU bf16 autocast (Accelerate wraps the result's forward; Dynamo
compiles a graph for the autocast call). Prints the loss of each step.
"""
from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import fxopt
from tiny_text_task import pad_to_longest, sentences, tiny_bert


def train(model: torch.nn.Module, mixed_precision: str = "no", epochs: int = 1) -> list[float]:
    """An Accelerate loop over 16 sentences in batches of 4; the loss of each step."""
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(sentences(16, seed=1), batch_size=4, shuffle=True, collate_fn=pad_to_longest)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for _ in range(epochs):
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def main(mixed_precision: str = "no") -> list[float]:
    set_seed(0)
    model = fxopt.optimize(tiny_bert(), mode="training", memory_budget=0.5)  # compiles on the first batch
    losses = train(model, mixed_precision)
    print(f"mixed_precision={mixed_precision}: losses {[round(x, 4) for x in losses]}; "
          f"graphs fxopt compiled: {len(model.fxopt_reports)}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "no")
