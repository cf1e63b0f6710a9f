"""A stand-in for hapi.Model with only the documented attributes a callback uses.

Callback tests drive the hooks directly with fake logs (Keras style), so they
need no data, no loop and no hapi import: what a callback does is visible in
this object (stop_training, optimizer.param_groups, network weights, saves).
"""

from __future__ import annotations

import os

import torch


class StubModel:
    def __init__(self, lr: float = 0.1) -> None:
        torch.manual_seed(0)
        self.network = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.network.parameters(), lr=lr)
        self.stop_training = False
        self.epoch = 0
        self.step = 0
        self.saved: list[str] = []

    def parameters(self):
        return self.network.parameters()

    def get_weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.network.state_dict().items()}

    def set_weights(self, weights: dict) -> None:
        self.network.load_state_dict(weights)

    def save(self, path: str, resumable: bool = False) -> None:
        self.saved.append(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(self.network.state_dict(), path + ".pt")

    def optimizer_step(self) -> None:
        """What one real optimizer step looks like from outside: step() ran, model.step grew."""
        self.optimizer.step()
        self.step += 1


def attach(callback, model: StubModel | None = None, rank: int = 0, **params):
    """set_model + set_params as the loop does; returns the model."""
    model = model or StubModel()
    callback.set_model(model)
    callback.set_params(
        {
            "epochs": 3,
            "steps": 4,
            "batch_size": 8,
            "verbose": 1,
            "log_freq": 1,
            "metrics": ["loss"],
            "rank": rank,
            "world_size": 2 if rank else 1,
            **params,
        }
    )
    return model


def as_evaluate(callback) -> None:
    """The params a standalone ``evaluate()`` gives (``epochs`` None): no fit is under way."""
    callback.set_params({**callback.params, "epochs": None})
