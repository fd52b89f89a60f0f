"""training_mode: profiling and warm-up steps run as training does, then give the model back as it was."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def training_mode(model):
    """Every module in training mode inside (transformers' layers checkpoint only when `training`,
    and a model fresh from from_pretrained is in eval mode); each module's own mode back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield model
    finally:
        for m, was in modes:
            m.training = was
