"""hapi.FSDP's units and copies on several processes (torchrun): tied weights, the optimizer, export.

python fsdp_units_script.py OUT_DIR SCENARIO...: each rank writes
OUT_DIR/units.rank<R>.json with what each scenario found. Scenarios:

* ``optimizer``: after the network is sharded, the optimizer steps the
  shards (DTensors, the very objects of ``network.parameters()``);
* ``tied``: a language model whose output layer is its embedding trains
  under the default units and under a ``wrap`` naming both tied modules;
* ``export``: ``model.export`` after FSDP training (a sharded forward on
  rank 0 alone used to wait for the others until HAPI_DIST_TIMEOUT); run it
  last, as a regression leaves the process group unusable.

The test runs the same training on one process at the global batch.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import fsdp_script  # noqa: E402

import hapi  # noqa: E402
from hapi.export import export_network  # noqa: E402

PER_PROCESS_BATCH = 4
VOCABULARY = 13


class TiedLM(nn.Module):
    """Embedding -> MLP -> output layer sharing the embedding's matrix (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCABULARY, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.fc2 = nn.Linear(8, VOCABULARY, bias=False)
        self.fc2.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.body(self.emb(tokens)))


def lm_data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token = (3 * token + 1) mod V: learnable, and every token's row gets gradients."""
    tokens = torch.randint(0, VOCABULARY, (n,), generator=torch.Generator().manual_seed(2))
    return tokens, (3 * tokens + 1) % VOCABULARY


def train_tied(strategy, batch_size: int, epochs: int = 2) -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(TiedLM())
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=0.02), nn.CrossEntropyLoss(), strategy=strategy
    )
    model.fit(lm_data(), batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0)
    return model


def full_weights(network: nn.Module) -> dict[str, list[float]]:
    """Every weight by name, gathered (a collective under FSDP); plain modules give their own."""
    state = get_model_state_dict(network, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().float().flatten().tolist() for name, value in state.items()}


def optimizer_case() -> dict:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = hapi.Model(fsdp_script.Blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model.prepare(optimizer, nn.CrossEntropyLoss(), strategy="fsdp")
    model.fit(fsdp_script.data(), batch_size=PER_PROCESS_BATCH, epochs=1, verbose=0)
    stepped = [p for group in model.optimizer.param_groups for p in group["params"]]
    held = list(model.network.parameters())
    return {
        "optimizer_is_users": model.optimizer is optimizer,
        "optimized_are_dtensors": [isinstance(p, DTensor) for p in stepped],
        "optimized_are_network_parameters": len(stepped) == len(held)
        and all(p is q for p, q in zip(stepped, held)),
        "state_is_sharded": all(
            isinstance(v, DTensor)
            for s in model.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ),
        "state_keys_are_network_parameters": {id(p) for p in model.optimizer.state}
        == {id(p) for p in held},
    }


def tied_case() -> dict:
    results = {}
    model = train_tied("fsdp", PER_PROCESS_BATCH)
    results["tied"] = full_weights(model.network)
    results["tie_kept"] = model.network.fc2.weight is model.network.emb.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named = train_tied(hapi.FSDP(wrap={nn.Embedding, nn.Linear}), PER_PROCESS_BATCH)
    results["tied_wrap"] = full_weights(named.network)
    results["tied_wrap_warnings"] = [str(w.message) for w in caught if "wrap=" in str(w.message)]
    results["tied_wrap_units"] = sorted(
        name
        for name, m in named.network.named_modules()
        if isinstance(m, torch.distributed.fsdp.FSDPModule)
    )
    return results


def export_case(out: pathlib.Path) -> dict:
    """Exports a trained Blocks and a tied LM; rank 0 runs the programs against predict()."""
    results = {}
    rank = int(os.environ.get("RANK", "0"))
    for name, model, inputs in (
        (
            "blocks",
            fsdp_script.train("sgd", PER_PROCESS_BATCH, "fsdp", epochs=1),
            fsdp_script.data(5)[0],
        ),
        ("tied", train_tied("fsdp", PER_PROCESS_BATCH, epochs=1), lm_data(5)[0]),
    ):
        predicted = model.predict((inputs,), batch_size=5, stack_outputs=True, verbose=0)[0]
        file = model.export(out / name, inputs)
        if rank == 0:
            program = torch.export.load(file).module()
            results[f"{name}_export_difference"] = (
                (program(inputs) - torch.as_tensor(predicted)).abs().max().item()
            )
        # What rank 0 exported: a plain copy (the user's classes, no FSDP hook, ties kept).
        build = model._strategy._inference_network(model.network)  # a collective
        if rank == 0:
            copy = build()
            results[f"{name}_copy_classes"] = sorted({type(m).__name__ for m in copy.modules()})
            results[f"{name}_copy_hooks"] = sum(
                len(m._forward_pre_hooks) + len(m._forward_hooks) for m in copy.modules()
            )
            results[f"{name}_copy_parameters"] = sorted(
                {type(p).__name__ for p in copy.parameters()}
            )
            with torch.no_grad():
                results[f"{name}_copy_difference"] = (
                    (copy(inputs) - torch.as_tensor(predicted)).abs().max().item()
                )
            if name == "tied":
                results["tied_copy_tie_kept"] = copy.fc2.weight is copy.emb.weight
        if name == "blocks":
            try:  # the function under model.export, on the sharded network itself
                export_network(model.network, out / "direct", inputs)
            except RuntimeError as error:
                results["direct_export_error"] = str(error)
        results[f"{name}_still_sharded"] = type(model.network).__name__.startswith("FSDP")
        # the process group is still usable: training goes on after the export
        labels = torch.zeros(len(inputs), dtype=torch.long)
        model.fit((inputs, labels), batch_size=2, epochs=1, verbose=0)
        results[f"{name}_trained_after_export"] = True
    return results


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1])
    outcome: dict = {}
    for scenario in sys.argv[2:]:
        outcome.update(
            export_case(out_dir) if scenario == "export" else globals()[f"{scenario}_case"]()
        )
    (out_dir / f"units.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(outcome))
