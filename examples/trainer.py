"""fxopt with Hugging Face Trainer: hand Trainer what `fxopt.optimize` returns, with no other change.

    python examples/trainer.py [OUTPUT_DIR]

Trains a tiny BERT for two epochs with a memory budget, evaluating and saving a checkpoint every epoch,
then loads the last checkpoint into the plain model class with `from_pretrained`.
"""
from __future__ import annotations

import sys
import tempfile

import torch
import transformers

import fxopt
from tiny_text_task import pad_to_longest, sentences, tiny_bert


def trainer_for(model: torch.nn.Module, output_dir: str, epochs: int = 2) -> transformers.Trainer:
    """A Trainer as for any model: evaluation and a checkpoint every epoch, on the CPU, no loggers."""
    args = transformers.TrainingArguments(
        output_dir=output_dir, num_train_epochs=epochs, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        eval_strategy="epoch", save_strategy="epoch", logging_steps=1, seed=0, report_to=[], use_cpu=True)
    return transformers.Trainer(model=model, args=args, train_dataset=sentences(16, seed=1),
                                eval_dataset=sentences(8, seed=2), data_collator=pad_to_longest)


def optimized_bert(memory_budget=0.5) -> torch.nn.Module:
    """The tiny BERT, optimized for training on an example batch (compiled now; other lengths compile on demand)."""
    torch.manual_seed(0)
    model = tiny_bert()
    example = pad_to_longest(sentences(4, seed=3))  # what Trainer will call it with: input_ids, attention_mask, labels
    options = {} if memory_budget is None else {"memory_budget": memory_budget}
    return fxopt.optimize(model, example_kwargs=example, mode="training", **options)


def main(output_dir: str) -> dict:
    trainer = trainer_for(optimized_bert(memory_budget=0.5), output_dir)
    trainer.train()
    metrics = trainer.evaluate()  # eval_loss: Trainer reads `labels` from the model's forward signature
    print(f"eval_loss {metrics['eval_loss']:.4f}; graphs fxopt compiled: {len(trainer.model.fxopt_reports)}")
    checkpoint = transformers.trainer_utils.get_last_checkpoint(output_dir)
    plain = transformers.BertForSequenceClassification.from_pretrained(checkpoint)  # the model's own checkpoint
    print(f"{checkpoint} loads into {type(plain).__name__}")
    return metrics


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
