"""Pretraining the base policy on code (`tabloop pretrain`): the loop and the command line
(run.py), its settings (config.py), the gate's fit (gate.py), the resume state (state.py) and
the training data (data.py). docs/MODEL.md says how the shipped base was made."""

from trainer.pretrain.config import SIZES, PretrainConfig
from trainer.pretrain.run import cpu_has_bf16, main, pretrain, split_files
from trainer.pretrain.state import load_state, save_state

__all__ = [
    "SIZES",
    "PretrainConfig",
    "cpu_has_bf16",
    "load_state",
    "main",
    "pretrain",
    "save_state",
    "split_files",
]
