"""Where the policy computes: the CPU in float32, or a CUDA GPU in bf16 autocast.

`TABLOOP_DEVICE` (tabloop.core.config.Settings.device) names it for serving, updates and
`tabloop pretrain --device`: "auto" (a GPU when torch sees one, else the CPU), "cpu", "cuda" or
"cuda:N". Weights stay float32 everywhere (the optimizer's master copy, checkpoints); on a GPU the
forward and backward passes run in bf16 autocast, and log-probs are taken in float32.

Code that computes with a placed model enters `compute(device)`: on a GPU it makes the device the
default for new tensors (torch.device as a context manager) and turns on autocast, so the model
code and the trainer's losses need no device arguments; on the CPU it does nothing. Random draws
that use a request's own generator stay on the CPU (sampling moves each step's logits there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class DeviceError(ValueError):
    """A device that cannot be used here (a GPU asked for where torch sees none)."""


def resolve(name: str) -> torch.device:
    """The torch device for a `TABLOOP_DEVICE` value; DeviceError if it is not usable."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {name!r} asked for, but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'})"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"{name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def precision(device: torch.device) -> str:
    """How a model computes there: "bf16 autocast" on a GPU, "fp32" on the CPU."""
    return "bf16 autocast" if device.type == "cuda" else "fp32"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's weights are on."""
    return next(model.parameters()).device


@contextlib.contextmanager
def compute(device: torch.device, bf16: bool | None = None) -> Iterator[None]:
    """Compute on `device`: new tensors are made there, and matrix products run in bf16 when
    `bf16` (default: on a GPU). On the CPU with the default this is a no-op, so the CPU paths are
    exactly what they are without it; bf16=True on the CPU is for tests of the bf16 path."""
    bf16 = device.type == "cuda" if bf16 is None else bf16
    with contextlib.ExitStack() as stack:
        if device.type != "cpu":
            stack.enter_context(device)
        if bf16:
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        yield


def activation_dtype(device: torch.device) -> torch.dtype:
    """The dtype activations come out in on `device` under the current autocast state (what a
    KV cache is allocated in)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32
