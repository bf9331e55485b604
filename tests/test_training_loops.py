"""fxopt's result in the training loops people hand models to: Hugging Face Trainer, Accelerate, a plain loop.

The model is a tiny BertForSequenceClassification from a config (SDPA attention, dropout 0.1), fed batches
padded to their own longest (examples/tiny_text_task.py). Every loss is compared with the same loop run on the
plain model from the same seeds: fxopt's eager lowering draws dropout's numbers as eager does, so they are equal.
The examples of docs/training-loops.md are run here. A Trainer run takes 4-8 s on 2 cores (fxopt compiles three
graphs: the example's length, every other length, and evaluation); the two tests that run more than one, with a
memory budget, took 10-16 s and are marked slow.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import io
import pathlib
import sys

import pytest
import torch
import transformers

import fxopt
from fxopt.frontends.result import OptimizedModule

pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # the examples import tiny_text_task as their neighbour
from tiny_text_task import pad_to_longest, sentences, tiny_bert  # noqa: E402


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"fxopt_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trainer_example = example("trainer")
accelerate_example = example("accelerate_loop")
plain_example = example("plain_loop")


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state (mixed precision included): each test starts its own."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def seeded_bert() -> transformers.BertForSequenceClassification:
    torch.manual_seed(0)
    return tiny_bert()


def step_losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def eval_losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]


@pytest.fixture(scope="module")
def eager_trainer_run(tmp_path_factory):
    """Trainer on the plain model: the losses every fxopt run must reproduce."""
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer = trainer_example.trainer_for(seeded_bert(), str(tmp_path_factory.mktemp("eager")))
    trainer.train()
    return {"steps": step_losses(trainer), "evals": eval_losses(trainer), "final": trainer.evaluate()["eval_loss"]}


def check_checkpoints(trainer: transformers.Trainer, output_dir: pathlib.Path) -> None:
    """A checkpoint per epoch, each the model's own (config.json, safetensors): the plain class loads the last one
    with `from_pretrained`, holding the weights the trainer ended with."""
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    last = output_dir / "checkpoint-8"
    assert (last / "config.json").exists() and (last / "model.safetensors").exists()
    plain = transformers.BertForSequenceClassification.from_pretrained(last)
    assert plain.config.architectures == ["BertForSequenceClassification"]
    trained = trainer.model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)


# ---- what Trainer and Accelerate read from the model ------------------------------------------------------------


def test_result_shows_trainer_the_model_signature_and_class_facts(tmp_path):
    """Trainer reads the model's columns, labels, loss flag and class facts from what fxopt.optimize returns."""
    model = seeded_bert()
    result = fxopt.optimize(model, mode="training", memory_budget=0.5)
    assert inspect.signature(result.forward) == inspect.signature(model.forward)
    assert type(result) is OptimizedModule and result.__class__ is type(model)
    assert isinstance(result, transformers.PreTrainedModel)
    for name in ("config", "main_input_name", "_keys_to_ignore_on_save", "supports_gradient_checkpointing"):
        assert getattr(result, name) is getattr(model, name), name
    trainer = trainer_example.trainer_for(result, str(tmp_path))
    assert trainer.label_names == ["labels"]
    assert trainer.can_return_loss == transformers.utils.can_return_loss(type(model))
    batch = next(iter(trainer.get_train_dataloader()))  # the KeyError: 'input_ids' came from here
    assert set(batch) == {"input_ids", "attention_mask", "labels"}


def test_result_saves_a_checkpoint_the_plain_class_loads(tmp_path):
    """`result.save_pretrained` writes the model's own checkpoint, which `from_pretrained` of its class loads."""
    model = seeded_bert()
    result = fxopt.optimize(model, mode="training")
    result.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["BertForSequenceClassification"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_result_still_pickles_and_copies_as_a_result():
    """With `__class__` the model's, deepcopy and torch.save still give an OptimizedModule with fxopt's options."""
    result = fxopt.optimize(seeded_bert(), mode="training", memory_budget=0.5)
    buffer = io.BytesIO()
    torch.save(result, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(result), torch.load(buffer, weights_only=False)):
        assert type(other) is OptimizedModule and other.__class__ is transformers.BertForSequenceClassification
        assert other._backend.options == result._backend.options
        assert inspect.signature(other.forward) == inspect.signature(result.forward)
        assert other.original is not result.original


class EngineMixin:
    """What FSDP2's `fully_shard` mixes into a module's class (`FSDPModule`: methods of its own)."""

    def engine_method(self):
        return "engine"


def test_an_engine_reclassing_the_result_in_place_keeps_it_optimized():
    """An engine re-classing the result in place as FSDP2 does (`type("FSDP" + name, (mixin, result.__class__))`)
    gives it the mixin's methods, keeps its compiled forward and still passes isinstance of the model's class."""
    model = seeded_bert()
    result = fxopt.optimize(model, mode="training")
    cls = result.__class__
    result.__class__ = type(f"Engine{cls.__name__}", (EngineMixin, cls), {})
    assert isinstance(result, (EngineMixin, OptimizedModule, transformers.BertForSequenceClassification))
    assert result.engine_method() == "engine"
    ids = torch.randint(0, 100, (2, 8))
    torch.manual_seed(0)
    result(ids, labels=torch.tensor([0, 1])).loss.backward()
    assert len(result.fxopt_reports) == 1  # the compiled forward ran, not the model's own


def test_trainer_does_not_unwrap_a_torch_compiled_model(tmp_path):
    """Trainer reads columns and labels from `torch.compile(model)` itself, whose forward names none
    (docs/training-loops.md says so and recommends `model.compile(...)` or fxopt.optimize instead)."""
    compiled = torch.compile(seeded_bert(), backend="fxopt")
    trainer = trainer_example.trainer_for(compiled, str(tmp_path))
    assert trainer.label_names == []
    model = seeded_bert()
    model.compile(backend="fxopt")  # in place: the model keeps its class and signature
    assert trainer_example.trainer_for(model, str(tmp_path)).label_names == ["labels"]


def test_accelerate_refuses_the_backend_name_fxopt(tmp_path):
    """Accelerate checks `torch_compile_backend` against its own list of names: "fxopt" is refused (documented)."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="fxopt",
                                          report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=seeded_bert(), args=args)


# ---- Trainer end to end -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_example_matches_eager(eager_trainer_run, tmp_path, budget_may_be_unmet):
    """examples/trainer.py (budget 0.5): Trainer trains, evaluates and saves as on the plain model, the same losses."""
    trainer = trainer_example.trainer_for(trainer_example.optimized_bert(memory_budget=0.5), str(tmp_path))
    trainer.train()
    assert step_losses(trainer) == eager_trainer_run["steps"]
    assert eval_losses(trainer) == eager_trainer_run["evals"]
    assert trainer.evaluate()["eval_loss"] == eager_trainer_run["final"]
    assert trainer.model.fxopt_reports, "fxopt compiled nothing"
    check_checkpoints(trainer, tmp_path)
    trainer_example.main(str(tmp_path / "main"))  # the script as the docs run it


def compiled_in_place():
    model = seeded_bert()
    model.compile(backend="fxopt", options={"inner": "eager"})  # eager lowering: eager's dropout numbers
    return model


@pytest.mark.parametrize("make_model", [
    pytest.param(lambda: trainer_example.optimized_bert(memory_budget=None), id="optimize"),
    pytest.param(compiled_in_place, id="model.compile-backend-fxopt"),
])
def test_trainer_matches_eager(make_model, eager_trainer_run, tmp_path):
    """Trainer on fxopt.optimize without a budget, and on the model compiled in place with backend "fxopt",
    gives eager's step and eval losses and checkpoints the plain class loads."""
    trainer = trainer_example.trainer_for(make_model(), str(tmp_path))
    trainer.train()
    assert step_losses(trainer) == eager_trainer_run["steps"]
    assert eval_losses(trainer) == eager_trainer_run["evals"]
    check_checkpoints(trainer, tmp_path)


class StopAfterFirstEpoch(transformers.TrainerCallback):
    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_training_stop = True


@pytest.mark.slow
def test_trainer_resumes_from_a_checkpoint(eager_trainer_run, tmp_path, budget_may_be_unmet):
    """A run stopped after one epoch resumes from its checkpoint into a fresh result and ends with eager's losses."""
    first = trainer_example.trainer_for(trainer_example.optimized_bert(), str(tmp_path))
    first.add_callback(StopAfterFirstEpoch())  # the same two-epoch schedule, stopped (checkpoint saved) after one
    first.train()
    assert step_losses(first) == eager_trainer_run["steps"][:4]
    resumed = trainer_example.trainer_for(trainer_example.optimized_bert(), str(tmp_path), epochs=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert step_losses(resumed) == eager_trainer_run["steps"]  # the first epoch's from the checkpoint's log history
    assert resumed.evaluate()["eval_loss"] == eager_trainer_run["final"]


# ---- Accelerate and a plain loop --------------------------------------------------------------------------------


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_example_matches_eager(mixed_precision, budget_may_be_unmet):
    """examples/accelerate_loop.py: prepare + backward on the result give eager's losses, in fp32 and CPU bf16."""
    from accelerate.utils import set_seed

    set_seed(0)
    eager = accelerate_example.train(tiny_bert(), mixed_precision)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert accelerate_example.main(mixed_precision) == eager


def test_plain_loop_example_matches_eager(tmp_path, budget_may_be_unmet):
    """examples/plain_loop.py: eager's losses, and the saved model loads into the plain class."""
    eager = plain_example.train(seeded_bert())
    assert plain_example.main(str(tmp_path)) == eager
    assert transformers.BertForSequenceClassification.from_pretrained(tmp_path).config.num_labels == 2
