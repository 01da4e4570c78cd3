"""A pretraining run's resume state: the model, the optimizer's moments and the data sampler's
generator, as safetensors and JSON (never a pickle)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tabloop.core.policy.model import (
    GPT,
)


# --- resume state (safetensors + JSON, never pickle) -------------------------------------
# Written as CPU tensors and read onto the CPU, whatever device the model is on: a run started
# on a GPU resumes on a CPU and the other way round.
def save_state(
    d: Path, model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator, meta: dict[str, Any]
) -> None:
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        str(tmp / "model.safetensors"),
    )
    sd = opt.state_dict()
    tensors = {
        f"{i}.{k}": (v.reshape(-1) if v.dim() == 0 else v).detach().cpu().contiguous()
        for i, st in sd["state"].items()
        for k, v in st.items()
    }
    tensors["generator"] = gen.get_state()
    save_file(tensors, str(tmp / "optim.safetensors"))
    meta = dict(meta, param_groups=sd["param_groups"])
    (tmp / "state.json").write_text(json.dumps(meta, indent=2, default=str))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)


def load_state(d: Path, model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    """Read the state saved by `save_state` into `model`, `opt` and the CPU generator `gen`;
    the tensors are read onto the CPU and copied to the model's device (the optimizer's
    load_state_dict puts the moments on their parameters' device)."""
    meta = json.loads((d / "state.json").read_text())
    model.load_state_dict(load_file(str(d / "model.safetensors"), device="cpu"))
    tensors = load_file(str(d / "optim.safetensors"), device="cpu")
    gen.set_state(tensors.pop("generator"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta
