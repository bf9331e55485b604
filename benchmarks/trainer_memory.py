"""Peak memory of a Hugging Face Trainer step: eager Trainer against Trainer on `fxopt.optimize(..., memory_budget=)`.

    python benchmarks/trainer_memory.py                       # BERT 4 x 256, batch 16, lengths 64-128
    python benchmarks/trainer_memory.py --budget 0.5 --steps 6 --layers 4 --hidden 256 --batch 16

BertForSequenceClassification from a config with the library's defaults (SDPA attention, dropout 0.1), token-id
sentences of 64 to 128 tokens padded per batch by a collator (a new length nearly every batch), `labels` in the
batch. Each Trainer trains `--steps` steps from the same seed (the first calls compile; lengths vary, so Dynamo
makes the length dynamic), and the losses are compared step by step. Then one more `trainer.training_step` on a
batch of a length neither has seen is measured, as Trainer's loop runs it (gradients set to None before it, so the
parameters' new gradients count): the allocator's peak of bytes allocated during the step and alive at once
(torch.profiler memory events, `fxopt.measure.allocator_peak`). Parameters and optimizer state, which exist before
the step, are not counted.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import transformers
from tabulate import tabulate

import fxopt
from fxopt.measure import allocator_peak

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_text_task import pad_to_longest  # noqa: E402  (the collator of the Trainer example)

VOCAB = 30522  # BERT's own vocabulary: its embedding's gradient is what it is in a real fine-tuning


def bert(layers: int, hidden: int) -> transformers.BertForSequenceClassification:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                                     num_labels=2)
    return transformers.BertForSequenceClassification(config)


def sentences(n: int, seed: int, lengths=(64, 129)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(*lengths, (1,), generator=g))
        rows.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist(),
                     "labels": int(torch.randint(0, 2, (1,), generator=g))})
    return rows


def trainer_run(options: argparse.Namespace, budget) -> tuple[list[float], int, int]:
    """(losses per step, the measured step's peak bytes, graphs fxopt compiled in training, graphs compiled in the
    measured step: 0 where a dynamic graph covers the new length) of one Trainer."""
    torch.manual_seed(0)
    model = bert(options.layers, options.hidden)
    if budget is not None:
        model = fxopt.optimize(model, mode="training", memory_budget=budget)
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir, max_steps=options.steps, per_device_train_batch_size=options.batch,
            logging_steps=1, save_strategy="no", seed=0, report_to=[], use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args, data_collator=pad_to_longest,
                                       train_dataset=sentences(options.batch * options.steps, seed=1))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        unseen = pad_to_longest(sentences(options.batch, seed=2, lengths=(131, 132)))  # length 131: never trained on
        (batch,), items = trainer.get_batch_samples(iter([unseen]), 1, args.device)  # as Trainer's loop calls it
        graphs = len(getattr(model, "fxopt_reports", []))
        trainer.model.zero_grad(set_to_none=True)  # as Trainer's loop leaves it between steps
        peak = allocator_peak(lambda: trainer.training_step(trainer.model_wrapped, batch, items))
        compiled_in_step = len(getattr(model, "fxopt_reports", [])) - graphs
    return losses, peak, graphs, compiled_in_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    eager_losses, eager_peak, _, _ = trainer_run(options, None)
    fxopt_losses, fxopt_peak, graphs, compiled_in_step = trainer_run(options, options.budget)
    print(f"BertForSequenceClassification {options.layers} x {options.hidden}, batch {options.batch}, "
          f"{options.steps} Trainer steps, then one at length 131; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    equal = "yes" if fxopt_losses == eager_losses else f"no: {fxopt_losses} vs {eager_losses}"
    print(tabulate([["eager Trainer", f"{eager_peak / 2**20:.1f}", "1.000", "", ""],
                    [f"fxopt, memory_budget={options.budget}", f"{fxopt_peak / 2**20:.1f}",
                     f"{fxopt_peak / eager_peak:.3f}", equal, f"{graphs} ({compiled_in_step} in the measured step)"]],
                   headers=["Trainer", "step peak MiB", "ratio", "losses equal eager's", "graphs compiled"]))


if __name__ == "__main__":
    main()
