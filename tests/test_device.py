"""The device-independent checks, on the device under test (FXOPT_TEST_DEVICE=cuda on a GPU machine):
the default pipeline in both modes, with a memory budget, on fuzzed networks, and under autocast
(bfloat16 on CPU; float16 with GradScaler on CUDA)."""
import copy

import pytest
import torch
import torch.nn as nn
from equivalence import assert_same_step
from fuzz import check, valid_case

import fxopt

pytestmark = pytest.mark.usefixtures("budget_may_be_unmet")  # budgets tiny models may not reach


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def mlp_blocks() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1))
                           for _ in range(6)])


NETS = {"conv": (conv_net, (4, 3, 8, 8)), "mlp": (mlp_blocks, (16, 32))}
VARIANTS = {"inference": ("inference", {}), "training": ("training", {}),
            "training+budget": ("training", {"memory_budget": 0.5})}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("net", list(NETS))
def test_default_pipeline_on_device(device, net, variant):
    """On the device under test, the optimized model's outputs, gradients and buffers equal the original's."""
    make, shape = NETS[net]
    mode, options = VARIANTS[variant]
    torch.manual_seed(0)
    model = make().to(device).train(mode == "training")
    inputs = (torch.randn(shape, device=device),)
    optimized = fxopt.optimize(model, inputs, mode=mode, **options)
    assert_same_step(model, optimized, inputs, training=mode == "training")


def test_fuzzed_networks_on_device(device):
    """Ten fuzzed networks (float64) on the device under test equal eager there."""
    findings = []
    for seed in range(9_000, 9_010):
        case = valid_case(seed)
        case.net.to(device)
        case.inputs = tuple(x.detach().to(device).requires_grad_(x.requires_grad) for x in case.inputs)
        outcome = check(case)
        if outcome.status != "ok":
            findings.append(f"seed {seed}: {outcome.detail.splitlines()[0]}")
    assert not findings, "\n".join(findings)


def train_steps(model: nn.Module, batches: list, device: torch.device) -> None:
    """SGD steps under autocast: bfloat16 on CPU; float16 with a GradScaler on CUDA."""
    cuda = device.type == "cuda"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda") if cuda else None
    for x in batches:
        with torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16):
            loss = model(x).float().square().mean()
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("net", list(NETS))
def test_autocast_training_matches_original(device, net):
    """Autocast training steps (with GradScaler on CUDA) through the optimized model reach the original's parameters."""
    make, shape = NETS[net]
    torch.manual_seed(0)
    reference = make().to(device).train()
    candidate = copy.deepcopy(reference)
    batches = [torch.randn(shape, device=device) for _ in range(3)]
    optimized = fxopt.optimize(candidate, (batches[0],), memory_budget=0.5)  # shares candidate's parameters
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(1)
        train_steps(reference, batches, device)
    torch.manual_seed(1)
    train_steps(optimized, batches, device)
    for (name, want), got in zip(reference.state_dict().items(), candidate.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
