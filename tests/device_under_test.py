"""The device the device-independent tests run on: `FXOPT_TEST_DEVICE=cuda pytest ...` (default cpu)."""
import os

import torch

DEVICE = torch.device(os.environ.get("FXOPT_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("FXOPT_TEST_DEVICE=cuda but torch sees no CUDA device")
